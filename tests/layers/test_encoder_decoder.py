"""EncoderDecoderCache, and BART (jaxkv.models.bart) against transformers.

Cache tests use a decoder self-attention half of each core kind (static, dynamic,
sliding with rollback slots) next to a cross half of ragged encoder inputs, with values
drawn so that every row differs: a batch edit that forgets a half, or mixes rows, shows.

Model tests build a tiny random ``BartForConditionalGeneration`` (layer norms and the
final logits bias perturbed so their loading is checked too), run a ragged batch of
encoder inputs with ragged decoder prompts and 32 teacher-forced decode steps, and compare
every step's logits with transformers' unbatched full-sequence logits within 1e-4
(float32); then greedy and sampled generation through the jitted ``generate``.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from jaxkv import Cache, EncoderDecoderCache, attention, attention_mask
from jaxkv.decoding.beam import beam_search
from jaxkv.decoding.driver import encode, pad_encoder_inputs
from jaxkv.decoding.generate import generate
from jaxkv.decoding.sampling import Sampling
from jaxkv.memory import layer_bytes
from jaxkv.models.bart import Bart, BartConfig, params_from_state_dict
from jaxkv.models.llama import Llama, LlamaConfig

BATCH, LAYERS, HEADS, HEAD_DIM, ENCODER_SLOTS = 3, 2, 2, 4, 6
ENCODER_LENGTHS = [6, 2, 4]  # ragged encoder inputs, right-padded to ENCODER_SLOTS
PROMPT_LENGTHS = [4, 1, 3]  # ragged decoder prefill
SELF_KINDS = {
    "static": {"layer_types": ["full_attention"] * LAYERS, "max_length": 16},
    "dynamic": {"layer_types": ["full_attention"] * LAYERS, "full_attention": "dynamic"},
    "sliding": {
        "layer_types": ["sliding_attention", "full_attention"],
        "max_length": 16,
        "sliding_window": 3,
        "rollback_slots": 2,
    },
}


def random_kv(key, num_tokens, batch=BATCH):
    keys, values = jax.random.normal(key, (2, batch, HEADS, num_tokens, HEAD_DIM))
    return keys, values


def decoder_step(cache, key, num_tokens, num_new=None):
    """Feed ``num_tokens`` random K/V per row (``num_new`` real ones) to every decoder layer."""
    positions = cache.next_positions(num_tokens, num_new)
    for layer, layer_key in enumerate(jax.random.split(key, LAYERS)):
        cache, _ = cache.update(layer, *random_kv(layer_key, num_tokens), positions)
    return cache


@functools.cache
def filled_cache(kind: str) -> EncoderDecoderCache:
    """Cross half filled from ragged encoder inputs, decoder half prefilled with ragged prompts."""
    settings = dict(SELF_KINDS[kind])
    self_attention = Cache.from_layer_types(
        settings.pop("layer_types"), batch_size=BATCH, num_kv_heads=HEADS, head_dim=HEAD_DIM, **settings
    )
    cache = EncoderDecoderCache.create(
        self_attention, encoder_length=ENCODER_SLOTS, num_kv_heads=HEADS, head_dim=HEAD_DIM
    )
    cross_keys, cross_values = jax.random.normal(jax.random.key(1), (2, LAYERS, BATCH, HEADS, ENCODER_SLOTS, HEAD_DIM))
    slots = np.arange(ENCODER_SLOTS)
    encoder_positions = np.where(slots[None] < np.array(ENCODER_LENGTHS)[:, None], slots[None], -1)
    cache = cache.with_cross_attention(cross_keys, cross_values, encoder_positions)
    if kind == "dynamic":
        cache = cache.reserve(8)
    return decoder_step(cache, jax.random.key(2), max(PROMPT_LENGTHS), PROMPT_LENGTHS)


def visible_slots(view):
    """The slot positions of a view and the K/V ``[n, H, D]`` of the slots its mask admits
    (what attention can read: stale slots behind the mask may differ)."""
    keys, values, mask_info = view
    visible = np.asarray(mask_info.kv_positions) >= 0
    in_slots = lambda x: np.asarray(x).transpose(0, 2, 1, 3)[visible]
    return np.asarray(mask_info.kv_positions), in_slots(keys), in_slots(values)


def assert_trees_equal(actual, expected):
    chex.assert_trees_all_equal_structs(actual, expected)
    chex.assert_trees_all_equal(actual, expected)


# --- the cross half ------------------------------------------------------------------
@pytest.mark.parametrize("kind", SELF_KINDS)
def test_cross_attention_admits_exactly_the_encoder_tokens(kind):
    """Every real decoder query, whatever its position (before, inside or past the encoder
    length), sees exactly its row's non-padding encoder slots; a padding query sees none;
    attention over the view is plain softmax over those slots."""
    cache = filled_cache(kind)
    q_positions = jnp.array([[0, 3, 40, -1]] * BATCH, jnp.int32)
    real_slots = np.arange(ENCODER_SLOTS)[None, :] < np.array(ENCODER_LENGTHS)[:, None]  # [B, S]
    for layer in range(LAYERS):
        view = cache.cross_attention(layer)
        keys, values, mask_info = view
        chex.assert_trees_all_equal((keys, values), (cache.cross_keys[layer], cache.cross_values[layer]))
        mask = np.asarray(attention_mask(q_positions, mask_info))  # [B, T, S]
        np.testing.assert_array_equal(mask[:, :3], np.repeat(real_slots[:, None], 3, axis=1))
        assert not mask[:, 3].any()

        queries = jax.random.normal(jax.random.key(layer), (BATCH, HEADS, 4, HEAD_DIM))
        out = np.asarray(attention(queries, view, q_positions))
        for row, n in enumerate(ENCODER_LENGTHS):
            logits = np.einsum("htd,hsd->hts", queries[row], keys[row, :, :n]) * HEAD_DIM**-0.5
            weights = np.exp(logits - logits.max(-1, keepdims=True))
            want = np.einsum("hts,hsd->htd", weights / weights.sum(-1, keepdims=True), values[row, :, :n])
            np.testing.assert_allclose(out[row, :, :3], want[:, :3], atol=1e-5)
            np.testing.assert_array_equal(out[row, :, 3], 0.0)


@pytest.mark.parametrize("kind", SELF_KINDS)
def test_update_writes_only_the_decoder_half(kind):
    cache = filled_cache(kind)
    keys, values = random_kv(jax.random.key(3), 1)
    positions = cache.lengths[:, None]
    updated, view = cache.update(0, keys, values, positions)
    want_self, want_view = cache.self_attention.update(0, keys, values, positions)
    assert_trees_equal(updated.self_attention, want_self)
    assert_trees_equal(view, want_view)
    assert_trees_equal(
        (updated.cross_keys, updated.cross_values, updated.encoder_positions),
        (cache.cross_keys, cache.cross_values, cache.encoder_positions),
    )
    np.testing.assert_array_equal(updated.lengths, np.array(PROMPT_LENGTHS) + 1)


# --- batch edits: both halves ----------------------------------------------------------
@pytest.mark.parametrize("kind", SELF_KINDS)
@given(indices=st.lists(st.integers(0, BATCH - 1), min_size=1, max_size=5))
def test_reorder_and_select_gather_rows_in_both_halves(kind, indices):
    """Row i of the result is row ``indices[i]`` in the decoder half (as ``Cache.reorder``)
    and in the cross half (keys, values, encoder positions): a beam keeps its encoder row."""
    cache = filled_cache(kind)
    rows = np.array(indices)
    for edited in (cache.reorder(rows), cache.select(jnp.asarray(rows))):
        assert_trees_equal(edited.self_attention, cache.self_attention.reorder(rows))
        chex.assert_trees_all_equal(
            (edited.cross_keys, edited.cross_values, edited.encoder_positions),
            (cache.cross_keys[:, rows], cache.cross_values[:, rows], cache.encoder_positions[rows]),
        )
        np.testing.assert_array_equal(edited.encoder_lengths, np.array(ENCODER_LENGTHS)[rows])
        np.testing.assert_array_equal(edited.lengths, np.array(PROMPT_LENGTHS)[rows])


def test_repeat_expands_both_halves_and_rejects_bad_indices():
    cache = filled_cache("static")
    repeated = cache.repeat(2)
    rows = np.repeat(np.arange(BATCH), 2)
    assert_trees_equal(repeated, cache.reorder(rows))
    np.testing.assert_array_equal(repeated.encoder_lengths, np.repeat(ENCODER_LENGTHS, 2))
    with pytest.raises(ValueError, match="num_repeats must be positive"):
        cache.repeat(0)
    with pytest.raises(IndexError, match="out of range for batch 3"):
        cache.reorder([0, 3])


# --- time edits: the decoder half only ---------------------------------------------------
@pytest.mark.parametrize("kind", SELF_KINDS)
def test_rollback_touches_only_the_decoder_and_refeeding_equals_never_feeding(kind):
    cache = filled_cache(kind)
    extended = decoder_step(cache, jax.random.key(4), 1)
    longer = decoder_step(extended, jax.random.key(5), 2)
    rolled = longer.rollback(2)
    np.testing.assert_array_equal(rolled.lengths, extended.lengths)
    assert_trees_equal(
        (rolled.cross_keys, rolled.cross_values, rolled.encoder_positions),
        (cache.cross_keys, cache.cross_values, cache.encoder_positions),
    )
    # Feeding the same tokens again gives exactly the views the never-rolled-back cache gave.
    positions = extended.next_positions(2)
    keys, values = random_kv(jax.random.key(6), 2)
    for layer in range(LAYERS):
        rolled, got = rolled.update(layer, keys, values, positions)
        extended, want = extended.update(layer, keys, values, positions)
        assert_trees_equal(visible_slots(got), visible_slots(want))


@pytest.mark.parametrize("kind", SELF_KINDS)
def test_reset_empties_both_halves_and_footprint_counts_both(kind):
    cache = filled_cache(kind)
    per_layer = layer_bytes(
        "cross_attention", batch_size=BATCH, seq_len=ENCODER_SLOTS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        dtype=jnp.float32,
    )  # fmt: skip
    assert per_layer == 2 * BATCH * ENCODER_SLOTS * HEADS * HEAD_DIM * 4
    assert cache.nbytes == cache.self_attention.nbytes + LAYERS * per_layer + 4 * BATCH * ENCODER_SLOTS
    assert (cache.max_length, cache.max_rollback) == (
        cache.self_attention.max_length,
        cache.self_attention.max_rollback,
    )
    reset = cache.reset()
    np.testing.assert_array_equal(reset.lengths, 0)
    np.testing.assert_array_equal(reset.encoder_lengths, 0)
    assert_trees_equal(reset.self_attention, cache.self_attention.reset())
    assert not np.any(reset.cross_keys) and not np.any(reset.cross_values)
    assert reset.nbytes == cache.nbytes
    assert "encoder lengths=[6, 2, 4]" in repr(cache)


# --- jit, donation, errors --------------------------------------------------------------
def test_cache_is_a_pytree_whose_operations_jit():
    """A jitted step (decoder update, cross read, beam reorder, rollback) equals the eager
    one, with the cache donated; the pytree round-trips through flatten/unflatten."""
    cache = filled_cache("sliding")
    leaves, treedef = jax.tree.flatten(cache)
    assert_trees_equal(jax.tree.unflatten(treedef, leaves), cache)
    keys, values = random_kv(jax.random.key(7), 1)
    beams = jnp.array([2, 2, 0])

    def step(cache, keys, values, beams):
        cache, view = cache.update(0, keys, values, cache.lengths[:, None])
        cross = cache.cross_attention(jnp.int32(1))
        return cache.reorder(beams).rollback(1), view.keys, cross.keys, cross.mask_info.kv_positions

    want = step(cache, keys, values, beams)
    got = jax.jit(step, donate_argnums=0)(jax.tree.map(jnp.copy, cache), keys, values, beams)
    assert_trees_equal(got, want)


def test_with_cross_attention_names_the_problem():
    cache = filled_cache("static")
    keys = cache.cross_keys
    with pytest.raises(ValueError, match=r"keys has shape .* encoder_length=5"):
        cache.with_cross_attention(keys[:, :, :, :5], cache.cross_values, cache.encoder_positions)
    with pytest.raises(TypeError, match="dtype=bfloat16"):
        cache.with_cross_attention(keys.astype(jnp.bfloat16), cache.cross_values, cache.encoder_positions)
    with pytest.raises(TypeError, match="encoder_positions must be integers"):
        cache.with_cross_attention(keys, cache.cross_values, cache.encoder_positions.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"encoder_positions has shape \(3, 5\)"):
        cache.with_cross_attention(keys, cache.cross_values, cache.encoder_positions[:, :5])
    with pytest.raises(ValueError, match="encoder_length must be positive"):
        EncoderDecoderCache.create(cache.self_attention, encoder_length=0, num_kv_heads=HEADS, head_dim=HEAD_DIM)


# --- BART against transformers -------------------------------------------------------------
VOCAB, DECODE_STEPS, START = 97, 32, 2
MODEL_ENCODER_LENGTHS = [13, 5, 9]
MODEL_PROMPT_LENGTHS = [5, 1, 3]  # decoder tokens before the 32 decode steps (start token first)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=48, max_position_embeddings=64,
        forced_eos_token_id=None, init_std=0.3,  # peaked distributions: outputs depend on the input
    )  # fmt: skip
    hf = transformers.BartForConditionalGeneration(config).eval()
    with torch.no_grad():  # make the norms' scales and shifts and the logits bias matter
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
        hf.final_logits_bias.add_(0.2 * torch.randn_like(hf.final_logits_bias))
    ours = BartConfig.model_validate(config.to_dict())
    model = Bart(ours, params_from_state_dict(ours, {k: v.numpy() for k, v in hf.state_dict().items()}))
    rng = np.random.default_rng(0)
    encoder_inputs = [rng.integers(3, VOCAB, n).tolist() for n in MODEL_ENCODER_LENGTHS]
    decoder_inputs = [[START] + rng.integers(3, VOCAB, n - 1 + DECODE_STEPS).tolist() for n in MODEL_PROMPT_LENGTHS]
    return hf, model, encoder_inputs, decoder_inputs


def right_padded(rows, width):
    tokens, positions = np.zeros((len(rows), width), np.int32), np.full((len(rows), width), -1, np.int32)
    for r, row in enumerate(rows):
        tokens[r, : len(row)], positions[r, : len(row)] = row, np.arange(len(row))
    return jnp.asarray(tokens), jnp.asarray(positions)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_prefill_and_decode_logits_match_transformers(bart, kind):
    hf, model, encoder_inputs, decoder_inputs = bart
    with torch.no_grad():
        expected = [
            hf(input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([dec])).logits[0].numpy()
            for enc, dec in zip(encoder_inputs, decoder_inputs)
        ]
    width = max(MODEL_PROMPT_LENGTHS)
    cache = model.init_cache(len(encoder_inputs), 64, encoder_length=16, full_attention=kind)
    cache = jax.jit(model.encode)(*right_padded(encoder_inputs, 16), cache).reserve(width + DECODE_STEPS)
    forward = jax.jit(model.__call__)
    tokens, _ = right_padded([dec[:n] for dec, n in zip(decoder_inputs, MODEL_PROMPT_LENGTHS)], width)
    logits, cache = forward(tokens, cache.next_positions(width, num_new=MODEL_PROMPT_LENGTHS), cache)
    for row, n in enumerate(MODEL_PROMPT_LENGTHS):
        np.testing.assert_allclose(logits[row, :n], expected[row][:n], atol=1e-4, rtol=0, err_msg=f"{kind} prefill")
    for step in range(DECODE_STEPS):
        token = jnp.asarray([[dec[n + step]] for dec, n in zip(decoder_inputs, MODEL_PROMPT_LENGTHS)], jnp.int32)
        logits, cache = forward(token, cache.lengths[:, None], cache)
        for row, n in enumerate(MODEL_PROMPT_LENGTHS):
            np.testing.assert_allclose(
                logits[row, 0], expected[row][n + step], atol=1e-4, rtol=0, err_msg=f"{kind} step {step}"
            )


def hf_generate(hf, encoder_inputs, **kwargs):
    """transformers' generate on the right-padded ragged batch; the new tokens per row."""
    input_ids, positions = right_padded(encoder_inputs, max(map(len, encoder_inputs)))
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor(np.asarray(input_ids), dtype=torch.long),
            attention_mask=torch.tensor(np.asarray(positions) >= 0, dtype=torch.long),
            max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=1, decoder_start_token_id=START, **kwargs,
        )  # fmt: skip
    return out[:, 1:].tolist()


def test_greedy_generate_matches_transformers(bart):
    hf, model, encoder_inputs, _ = bart
    result = generate(model, [[START]] * len(encoder_inputs), encoder_inputs=encoder_inputs, max_new_tokens=NEW_TOKENS)
    want = hf_generate(hf, encoder_inputs, do_sample=False)
    assert [result.row(r) for r in range(len(encoder_inputs))] == want


def test_sampled_generate_draws_from_the_models_top_k(bart):
    """Sampling through the same jitted generate: with top_k=1 it is greedy; with top_k=5
    every drawn token is among transformers' 5 most likely at its step (teacher-forced on
    the drawn prefix), and a seed reproduces its draw."""
    hf, model, encoder_inputs, _ = bart
    prompts = [[START]] * len(encoder_inputs)
    run = functools.partial(generate, model, prompts, encoder_inputs=encoder_inputs, max_new_tokens=NEW_TOKENS)
    top1 = run(sampling=Sampling(temperature=0.7, top_k=1), seed=3)
    assert [top1.row(r) for r in range(len(prompts))] == hf_generate(hf, encoder_inputs, do_sample=False)
    sampled = run(sampling=Sampling(temperature=1.5, top_k=5), seed=3)
    np.testing.assert_array_equal(sampled.tokens, run(sampling=Sampling(temperature=1.5, top_k=5), seed=3).tokens)
    assert sampled.tokens.tolist() != top1.tokens.tolist()
    for row, enc in enumerate(encoder_inputs):
        drawn = sampled.row(row)
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([[START] + drawn])).logits[0]
        top5 = torch.topk(logits[:-1], 5).indices.numpy()
        assert all(token in top5[step] for step, token in enumerate(drawn)), row


def test_generate_needs_encoder_inputs_exactly_for_encoder_decoder_models(bart):
    _, model, encoder_inputs, _ = bart
    with pytest.raises(ValueError, match="is an encoder-decoder model: pass encoder_inputs"):
        generate(model, [[START]], max_new_tokens=2)
    with pytest.raises(ValueError, match="one non-empty encoder input per prompt: 3 for 1"):
        generate(model, [[START]], encoder_inputs=encoder_inputs, max_new_tokens=2)
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        generate(model, [[START]], encoder_inputs=[[5] * 65], max_new_tokens=2)
    llama = Llama(
        LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(TypeError, match="Llama does not implement EncoderDecoderModel: missing encode"):
        generate(llama, [[START]], encoder_inputs=[[5]], max_new_tokens=2)


def test_beam_search_matches_transformers(bart):
    """``jaxkv.decoding.beam`` over an encoded cache: the search repeats and reorders both halves of
    the EncoderDecoderCache; each row's hypotheses and scores equal transformers' beam
    search on that encoder input alone."""
    hf, model, encoder_inputs, _ = bart
    tokens, positions = pad_encoder_inputs(model, encoder_inputs, len(encoder_inputs))
    cache = model.init_cache(len(encoder_inputs), 32, encoder_length=tokens.shape[1])
    cache = encode(*nnx.split(model), cache, tokens, positions)
    stops = [hf_generate(hf, encoder_inputs[:1], do_sample=False)[0][2]]  # a token the model emits
    result = beam_search(
        model, [[START]] * len(encoder_inputs), cache=cache, max_new_tokens=NEW_TOKENS, num_beams=3,
        num_return_sequences=2, stop_tokens=stops,
    )  # fmt: skip
    for row, enc in enumerate(encoder_inputs):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([enc]), max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=3, num_return_sequences=2,
                eos_token_id=stops, pad_token_id=1, decoder_start_token_id=START, return_dict_in_generate=True,
                output_scores=True,
            )  # fmt: skip
        lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
        want = [out.sequences[i, 1 : 1 + n].tolist() for i, n in enumerate(lengths)]
        assert [result.sequence(row, rank) for rank in range(2)] == want, row
        np.testing.assert_allclose(result.scores[row], out.sequences_scores.numpy(), atol=1e-4)


def test_loading_names_what_is_wrong(bart):
    hf, _, _, _ = bart
    tensors = {name: t.numpy() for name, t in hf.state_dict().items()}
    config = BartConfig.model_validate(hf.config.to_dict())
    missing = dict(tensors)
    del missing["model.decoder.layers.2.encoder_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model.decoder.layers.2.encoder_attn.k_proj.bias'\]"):
        params_from_state_dict(config, missing)
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        params_from_state_dict(config, tensors | {"extra.weight": np.zeros(1)})
    with pytest.raises(ValueError, match="lm_head.weight differs from model.shared.weight"):
        params_from_state_dict(config, tensors | {"lm_head.weight": tensors["lm_head.weight"] + 1})
    for change, message in (
        ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
        ({"model_type": "mbart"}, "got model_type 'mbart'"),
        ({"activation_function": "tanh"}, "activation_function 'tanh' is not supported"),
        ({"decoder_attention_heads": 5}, "not a multiple of decoder_attention_heads 5"),
    ):
        with pytest.raises(ValueError, match=message):
            BartConfig.model_validate(hf.config.to_dict() | change)
