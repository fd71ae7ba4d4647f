"""DeepSeek-V3.2 (MLA + DSA + MoE) logits, indexer selections and greedy tokens equal transformers'.

A tiny random checkpoint is built and saved by transformers and loaded through our loader. The
context (17 + 32 tokens) is longer than ``index_topk`` (8), so every query past position 7
attends a selection: the indexer's choice must be transformers' top-k, or the logits differ.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jaxkv.models.deepseek_v32 import DeepseekV32, indexer_inputs, rotation
from jaxkv.models.weights import load_safetensors_checkpoint

from jaxkv.decoding.generate import generate, prefill_prefix
from jaxkv.decoding.speculative import PromptLookup, generate_speculative
from jaxkv.layers.indexed import select_slots
from jaxkv.protocol import MaskInfo
from jaxkv.serving import Engine
from tests.cases import greedy_reference, run_arrivals
from tests.parity import check_teacher_forced, hf_greedy, save_tiny_hf_model

VOCAB, TOPK = 97, 8
CONFIG = transformers.DeepseekV32Config(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=12, index_topk=TOPK, index_head_dim=16, index_n_heads=8,
    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
)  # fmt: skip
# YaRN as the released checkpoints have it (their factor 40 over 4096 positions, here 4 over 32):
# frequencies blended, cos/sin scaled by mscale / mscale_all_dim, the softmax by mscale_all_dim's square.
YARN = {
    "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 32,
    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32, "beta_slow": 1,
}  # fmt: skip
PROMPTS = [17, 6]  # ragged rows
DECODE_STEPS = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_v32")
    sequences, expected, hf = save_tiny_hf_model(
        CONFIG, directory, VOCAB, PROMPTS, DECODE_STEPS, perturb_norms=True, attn_implementation="eager"
    )
    config, params = load_safetensors_checkpoint(directory)
    return sequences, expected, hf, DeepseekV32(config, params)


def test_yarn_logits_match_transformers(tmp_path):
    config = transformers.DeepseekV32Config(**{**CONFIG.to_dict(), "rope_parameters": YARN})
    sequences, expected, _ = save_tiny_hf_model(config, tmp_path, VOCAB, PROMPTS, 0, attn_implementation="eager")
    model = DeepseekV32(*load_safetensors_checkpoint(tmp_path))
    assert model.config.rope_scaling.mscale_all_dim == 0.5 and rotation(model.config).attention_factor != 1.0
    check_teacher_forced(model, model.init_cache(len(PROMPTS), max_length=32), sequences, PROMPTS, expected, 0, "yarn")


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_prefill_and_decode_logits_match_transformers(checkpoint, kind):
    sequences, expected, _, model = checkpoint
    cache = model.init_cache(len(PROMPTS), max_length=64, full_attention=kind)
    cache = check_teacher_forced(model, cache, sequences, PROMPTS, expected, DECODE_STEPS, f"deepseek_v32 {kind}")
    assert np.asarray(cache.lengths).tolist() == [n + DECODE_STEPS for n in PROMPTS]


def test_indexer_selects_transformers_top_k(checkpoint):
    """On transformers' own indexer inputs (layer 1's normed hidden states and query latent), our
    scores pick, for every query, the positions transformers' top-k picks among those it may see."""
    sequences, _, hf, model = checkpoint
    seen = {}
    hook = hf.model.layers[1].self_attn.indexer.register_forward_hook(
        lambda module, args, out: seen.update(h=args[0], q_resid=args[1], topk=out)
    )
    with torch.no_grad():
        hf(torch.tensor(sequences[0])[None])
    hook.remove()
    config = model.config
    w = {name: param[...][1] for name, param in model.layers.items() if param[...].shape[0] == config.num_hidden_layers}
    length = len(sequences[0])
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    indexer, keys = indexer_inputs(
        config, w, jnp.asarray(seen["h"].numpy()), jnp.asarray(seen["q_resid"].numpy()), positions,
        rotation(config),
    )  # fmt: skip
    slots, chosen = select_slots(indexer, keys, positions, MaskInfo(positions), TOPK)
    slots, chosen, theirs = np.asarray(slots[0]), np.asarray(chosen[0]), seen["topk"][0].numpy()
    assert length > TOPK and theirs.shape == (length, TOPK)
    for t in range(length):
        assert set(slots[t][chosen[t]].tolist()) == {s for s in theirs[t].tolist() if s <= t}, f"query {t}"


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_greedy_generate_matches_transformers(checkpoint, kind):
    """The jitted generate (prefill, then the while_loop decode) gives HF's greedy tokens for 32 steps."""
    sequences, _, hf, model = checkpoint
    prompts = [seq[:n].tolist() for seq, n in zip(sequences, PROMPTS)]
    result = generate(model, prompts, max_new_tokens=DECODE_STEPS, full_attention=kind)
    for row, want in enumerate(hf_greedy(hf, prompts, DECODE_STEPS, eos_token_id=None, pad_token_id=0)):
        assert result.row(row) == want, (kind, row)


def test_a_shared_prefix_continues_as_transformers(checkpoint):
    """A 10-token prefix (past ``index_topk``) prefilled once, repeated for two continuations (its
    indexer keys travel with the rows) and left unchanged: greedy tokens equal transformers' on
    prefix + continuation."""
    sequences, _, hf, model = checkpoint
    prefix = sequences[0][:10].tolist()
    shared = prefill_prefix(model, [prefix], max_length=64)
    continuations = [sequences[0][10:17].tolist(), sequences[1][:5].tolist()]
    result = generate(model, continuations, max_new_tokens=8, cache=shared)
    expected = hf_greedy(hf, [prefix + c for c in continuations], 8, eos_token_id=None, pad_token_id=0)
    assert [result.row(row) for row in range(2)] == expected
    assert np.asarray(shared.lengths).tolist() == [10]


def test_engine_equals_generate(checkpoint):
    """Requests arriving at different steps, their prefills chunked, through the serving engine
    (each request's latent and indexer keys in pages, prompts sharing prefixes hitting the prefix
    cache): ``generate``'s greedy tokens, with contexts past ``index_topk``."""
    sequences, _, _, model = checkpoint
    prompts = [seq[:n].tolist() for seq in sequences for n in (9, 17)]
    engine = Engine(
        model, kv_memory=256 * 1024, page_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64
    )  # fmt: skip
    assert run_arrivals(engine, prompts, [0, 0, 2, 4], 12) == greedy_reference(model, prompts, 12)


def test_speculative_greedy_equals_plain_greedy(checkpoint):
    """Prompt-lookup drafts verified and rolled back on DSA layers (the rejected tokens' latents
    and indexer keys forgotten, the selection recomputed) give transformers' greedy tokens."""
    sequences, _, hf, model = checkpoint
    prompts = [seq[:n].tolist() * 2 for seq, n in zip(sequences, (8, 5))]  # repeats for the lookup to find
    spec = generate_speculative(model, prompts, drafter=PromptLookup(), num_draft_tokens=3, max_new_tokens=16)
    assert spec.tokens.tolist() == hf_greedy(hf, prompts, 16, eos_token_id=None, pad_token_id=0)
    assert np.sum(spec.accepted) < 3 * np.sum(spec.target_steps), "no draft was rejected: rollback not exercised"
