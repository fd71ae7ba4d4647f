"""Quantized K/V: round-trip bounds, the layer against a float reference of the same
quantization, beam edits over every leaf, allocated dtypes, bytes, errors, generation."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import Cache, attention
from jaxkv.cli.generate import resolve_config
from jaxkv.config import CacheConfig
from jaxkv.decoding.generate import generate
from jaxkv.memory import cache_bytes, layer_bytes
from jaxkv.layers.quantized import QuantizedLayer, quantized_lengths
from jaxkv.protocol import KVView
from jaxkv.quantization import PER_CHANNEL, PER_TOKEN, QuantSpec, dequantize, quantize
from jaxkv.models.llama import Llama, LlamaConfig
from tests.oracle import full_attention

HEAD_DIM = 8
GROUP = 4
FORMATS = [
    QuantSpec(nbits=8, q_group_size=GROUP),
    QuantSpec(nbits=4, q_group_size=GROUP),
    QuantSpec(nbits=2, q_group_size=GROUP),
    QuantSpec(format="e4m3", q_group_size=GROUP),
    QuantSpec(format="e5m2", q_group_size=GROUP),
]
KIVI = QuantSpec(nbits=4, axis_key=PER_CHANNEL, axis_value=PER_TOKEN, q_group_size=GROUP, residual_length=8)


def spread_values(shape, seed=0):
    """Normal values whose magnitude varies by channel and by token over 3 orders: a group
    formed along the wrong axis gets a far wider range and breaks the per-group bound."""
    rng = np.random.default_rng(seed)
    channel = np.exp(rng.uniform(-3, 3, shape[-1]))
    token = np.exp(rng.uniform(-3, 3, shape[-2]))[:, None]
    return jnp.asarray(rng.normal(size=shape) * channel * token, jnp.float32)


def per_group(x, axis, reduce):
    """``reduce`` over each group of ``x`` ``[..., S, D]``, broadcast back to ``x``'s shape."""
    *lead, length, dim = x.shape
    if axis == PER_TOKEN:
        g = x.reshape(*lead, length, dim // GROUP, GROUP)
        return np.repeat(reduce(g, axis=-1), GROUP, axis=-1)
    g = x.reshape(*lead, length // GROUP, GROUP, dim)
    return np.repeat(reduce(g, axis=-2), GROUP, axis=-2)


@pytest.mark.parametrize("axis", [PER_TOKEN, PER_CHANNEL])
@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: f"{s.format}{s.bits}")
def test_round_trip_error_is_bounded_per_group(spec, axis):
    x = spread_values((2, 3, 16, HEAD_DIM))
    back = np.asarray(dequantize(quantize(x, spec, axis), spec, axis))
    xs = np.asarray(x, np.float64)
    error = np.abs(back - xs)
    low, high = per_group(xs, axis, np.min), per_group(xs, axis, np.max)
    if spec.format == "int":
        # Half a step, plus float16 rounding of the scale (over 2**bits steps) and zero point.
        step = (high - low) / (2**spec.bits - 1)
        bound = 0.5 * step + 2**-11 * ((high - low) + np.abs(low)) + 1e-7
    else:
        # fp8 relative rounding (3 or 2 mantissa bits), plus the subnormal floor below the group's max.
        mantissa = {"e4m3": 3, "e5m2": 2}[spec.format]
        amax = per_group(np.abs(xs), axis, np.max)
        smallest = float(jnp.finfo(spec.number_dtype).smallest_subnormal / jnp.finfo(spec.number_dtype).max)
        bound = np.abs(xs) * (2.0 ** -(mantissa + 1) + 2**-10) + amax * smallest
    assert np.all(error <= bound), f"worst excess {np.max(error - bound)}"


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: f"{s.format}{s.bits}")
def test_allocated_dtypes_are_the_packed_codes(spec):
    """The storage really is uint8 (packed int codes, or fp8 bit patterns), scales float16; the residual keeps
    the cache dtype: nothing silently falls back to the full-precision dtype."""
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": HEAD_DIM,
              "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}  # fmt: skip
    cache = Cache.from_config(config, 2, max_length=32, dtype=jnp.bfloat16, quantization=spec)
    for layer in cache.layers:
        assert isinstance(layer, QuantizedLayer)
        for stored in (layer.quantized_keys, layer.quantized_values):
            chex.assert_type(stored.codes, jnp.uint8)
            assert stored.codes.shape[-1] == HEAD_DIM * spec.bits // 8
            chex.assert_type(stored.scales, jnp.float16)
            assert (stored.zeros is not None) == (spec.format == "int")
        chex.assert_type([layer.residual_keys, layer.residual_values], jnp.bfloat16)


@functools.partial(jax.jit, static_argnums=(1, 2))
def round_trip(x, spec, axis):
    """``x`` ``[..., S, D]`` quantized along ``axis`` and back: one compile per shape and spec."""
    return dequantize(quantize(x, spec, axis), spec, axis)


def fake_quantized(sequence, round_tripped, num_quantized):
    """One row ``[H, L, D]``: its first ``num_quantized`` tokens from ``round_tripped`` (the row's
    whole buffer ``[H, S >= L, D]`` quantized and back), the rest as is. A group never straddles
    ``num_quantized`` (per token: one token's channels; per channel: Q is a multiple of the group,
    as ``QuantSpec`` requires of the residual), so this is the first Q tokens' own round trip."""
    return np.concatenate([round_tripped[:, :num_quantized], sequence[:, num_quantized:]], axis=1)


@st.composite
def feeds(draw):
    """Rows of different lengths fed in random chunk widths, some rows padding per update."""
    batch = draw(st.sampled_from([1, 2]))
    steps, lengths = [], [0] * batch
    for _ in range(draw(st.integers(1, 4))):
        width = draw(st.sampled_from([1, 3, 13]))
        counts = [draw(st.integers(0, min(width, 30 - n))) for n in lengths]
        lengths = [n + c for n, c in zip(lengths, counts)]
        steps.append((width, counts))
    return batch, steps


def update_and_attend(layer, q, k, v, positions, block_size):
    """One update of ``layer`` with ``k``/``v`` ``[B, H, T, D]``, then attention of ``q`` ``[B, H_q, T, D]``."""
    layer, kv = layer.update(k, v, positions)
    return layer, attention(q, kv, positions, block_size=block_size)


class LayerEqualsFakeQuantizedReference(chex.TestCase):
    """Each update's attention equals exact attention over the row's sequence with the
    tokens the layer holds quantized (first Q of the row's length after the update)
    replaced by their quantize-dequantize round trip."""

    def check(self, spec, window, batch, steps, block_size=8):
        heads, q_heads = 2, 4
        layer = QuantizedLayer.create(batch, heads, HEAD_DIM, spec, max_length=None if window else 32, window=window,
                                      rollback_slots=2)  # fmt: skip
        rng = np.random.default_rng(len(steps))
        keys, values = (rng.normal(size=(batch, heads, 32, HEAD_DIM)).astype(np.float32) for _ in range(2))
        queries = rng.normal(size=(batch, q_heads, 32, HEAD_DIM)).astype(np.float32)
        keys_back = np.asarray(round_trip(jnp.asarray(keys), spec, spec.axis_key))
        values_back = np.asarray(round_trip(jnp.asarray(values), spec, spec.axis_value))
        # One module-level function: every example and test of a shape shares its compile.
        step = functools.partial(self.variant(update_and_attend, static_argnames="block_size"), block_size=block_size)
        fed = np.zeros(batch, int)
        for width, counts in steps:
            positions = np.full((batch, width), -1)
            pick = np.zeros((batch, width), int)
            for r in range(batch):
                positions[r, : counts[r]] = fed[r] + np.arange(counts[r])
                pick[r, : counts[r]] = positions[r, : counts[r]]

            def chunk(x, pick=pick):
                return jnp.asarray(np.take_along_axis(x, pick[:, None, :, None], axis=2))

            layer, out = step(layer, chunk(queries), chunk(keys), chunk(values), jnp.asarray(positions))
            fed += counts
            for r in range(batch):
                if not counts[r]:
                    continue
                length = fed[r]
                num_q = int(quantized_lengths(jnp.asarray(length), spec.residual_length))
                k_ref = fake_quantized(keys[r, :, :length], keys_back[r], num_q)
                v_ref = fake_quantized(values[r, :, :length], values_back[r], num_q)
                want = full_attention(queries[r, :, :length], k_ref, v_ref, window=window)
                np.testing.assert_allclose(out[r, :, : counts[r]], want[:, length - counts[r] :], atol=2e-5, rtol=0)
        chex.assert_trees_all_equal(layer.lengths, jnp.asarray(fed, jnp.int32))

    # Jitted only, few examples (each new chunk width compiles); attention reads blocks of 8.
    @chex.variants(with_jit=True)
    @settings(max_examples=5)
    @given(feeds(), st.sampled_from([KIVI, QuantSpec(nbits=8, q_group_size=GROUP, residual_length=3),
                                     QuantSpec(format="e4m3", q_group_size=GROUP, residual_length=0)]))  # fmt: skip
    def test_full_attention(self, plan, spec):
        self.check(spec, None, *plan)

    @chex.variants(with_jit=True)
    @settings(max_examples=5)
    @given(feeds(), st.sampled_from([KIVI, QuantSpec(nbits=2, q_group_size=GROUP, residual_length=2)]))
    def test_sliding_window(self, plan, spec):
        self.check(spec, 6, *plan)

    @chex.variants(without_jit=True)
    def test_eager_ragged_prefill_then_decode(self):
        """The same eagerly (where positions are checked), one fixed plan, since op-by-op
        dispatch is slow: a ragged prefill that flushes blocks, then a token and a chunk."""
        self.check(KIVI, None, 2, [(13, [13, 9]), (1, [1, 0]), (3, [3, 3])], block_size=256)


def test_blocked_reads_equal_dequantizing_the_whole_cache():
    """Attention reading the view block by block equals attention over its whole keys/values."""
    layer = QuantizedLayer.create(2, 2, HEAD_DIM, KIVI, max_length=32)
    rng = np.random.default_rng(1)
    k, v, q = (jnp.asarray(rng.normal(size=(2, h, 21, HEAD_DIM)), jnp.float32) for h in (2, 2, 4))
    positions = jnp.asarray([np.arange(21), np.where(np.arange(21) < 13, np.arange(21), -1)])
    _, view = jax.jit(QuantizedLayer.update)(layer, k, v, positions)  # compiled setup; the reads run eagerly
    whole = attention(q, view, positions, block_size=256)
    blocked = attention(q, view, positions, block_size=8)
    chex.assert_trees_all_close(blocked, whole, atol=1e-6)
    # Any slot range, not only aligned blocks: start mid-group, size not a multiple of G.
    keys, values = view.read(3, 10)
    chex.assert_trees_all_close((keys, values), (view.keys[:, :, 3:13], view.values[:, :, 3:13]), atol=0)


@pytest.mark.parametrize("capacity", [32, 16])
def test_decode_step_reads_the_store_in_blocks_and_the_residual_once(capacity):
    """A batch-1 decode step (one query: one product per K/V head over the dequantized blocks,
    then the residual as the view's tail) equals attention over the view's merged keys and
    values as plain arrays (one product per query head); past the capacity too (under jit,
    where the tokens that do not fit are dropped as in ``StaticLayer``)."""
    layer = QuantizedLayer.create(1, 2, HEAD_DIM, KIVI, max_length=capacity)
    rng = np.random.default_rng(2)
    k, v = (jnp.asarray(rng.normal(size=(1, 2, 20, HEAD_DIM)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(1, 4, 1, HEAD_DIM)), jnp.float32)

    @jax.jit
    def step(layer, k, v, position):
        layer, view = layer.update(k, v, position)
        merged = KVView.of(view.keys, view.values, view.mask_info.replace(slots_used=None))
        return layer, (attention(q, view, position, block_size=8), attention(q, merged, position))

    fill = min(20, capacity - 2)  # a capacity of 16: the last two steps land past it
    layer = feed(layer, k[:, :, :fill], [fill])
    for position in range(fill, fill + 4):
        token = k[:, :, position % 20][:, :, None]
        layer, (blocked, whole) = step(layer, token, token, jnp.asarray([[position]]))
        chex.assert_trees_all_close(blocked, whole, atol=1e-6)


@jax.jit
def feed(layer, x, lengths):
    """Rows of ``x`` ``[B, H, S, D]`` fed as one ragged update of ``lengths`` tokens (keys = values = x);
    compiled: a test's setup, where op-by-op dispatch would compile each op per shape."""
    width = x.shape[2]
    positions = jnp.where(jnp.arange(width)[None] < jnp.asarray(lengths)[:, None], jnp.arange(width)[None], -1)
    return layer.update(x, x, positions)[0]


@pytest.mark.parametrize("window", [None, 6])
def test_beam_reorder_equals_reordering_before_quantizing(window):
    """Reordering a quantized cache (codes, scales, zero points, residual, positions) equals
    quantizing the reordered sequences: beams are never mixed."""
    x = spread_values((3, 2, 19, HEAD_DIM))
    lengths = np.array([19, 11, 14])  # every row has quantized blocks and a partial residual

    def build(rows):
        layer = QuantizedLayer.create(len(rows), 2, HEAD_DIM, KIVI, max_length=None if window else 24, window=window)
        return feed(layer, x[jnp.asarray(rows)], lengths[rows])

    cache = Cache((jax.tree.map(lambda leaf: leaf[None], build([0, 1, 2])),), ("full_attention",), 1)
    chex.assert_trees_all_equal(cache.reorder(jnp.asarray([2, 0, 0])).layer(0), build([2, 0, 0]))
    chex.assert_trees_all_equal(cache.select(jnp.asarray([1])).repeat(2).layer(0), build([1, 1]))


def test_rollback_within_and_past_the_residual():
    """Within the residual a rollback only shortens the row; past it, the last partial
    block returns to the residual in its dequantized form, and refeeding continues."""
    spec = QuantSpec(nbits=4, q_group_size=GROUP, residual_length=4)
    x = spread_values((1, 2, 12, HEAD_DIM))
    layer = feed(QuantizedLayer.create(1, 2, HEAD_DIM, spec, max_length=16), x, [10])  # Q = 8, residual 8..9
    within = layer.rollback(1)
    chex.assert_trees_all_equal(within.residual_keys, layer.residual_keys)
    assert int(within.lengths[0]) == 9
    past = layer.rollback(4)  # length 6: Q = 4, positions 4..5 come back from the store
    assert int(past.lengths[0]) == 6
    back = round_trip(x, spec, PER_TOKEN)
    chex.assert_trees_all_close(past.residual_keys[:, :, :2], back[:, :, 4:6], atol=1e-6)
    again = past.update(x[:, :, 6:9], x[:, :, 6:9], jnp.arange(6, 9)[None])[1]
    np.testing.assert_array_equal(np.asarray(again.mask_info.kv_positions[0, :10]), list(range(9)) + [-1])
    # Length 9: Q = 8, so 6..7 were quantized with the block they complete; 8 is the residual.
    chex.assert_trees_all_close(again.keys[:, :, 6:8], back[:, :, 6:8], atol=1e-6)
    chex.assert_trees_all_close(again.keys[:, :, 8], x[:, :, 8], atol=1e-6)
    ring = feed(QuantizedLayer.create(1, 2, HEAD_DIM, spec, window=4, rollback_slots=1), x, [10])
    assert ring.max_rollback == 2
    with pytest.raises(ValueError, match="can undo at most 2"):
        ring.rollback(3)


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize(
    "spec", [KIVI, QuantSpec(nbits=8, q_group_size=GROUP), QuantSpec(format="e5m2", axis_key=PER_CHANNEL, q_group_size=GROUP, residual_length=4)]
)  # fmt: skip
def test_nbytes_formula_counts_scales_and_zero_points(spec, window):
    layer = QuantizedLayer.create(2, 3, HEAD_DIM, spec, jnp.bfloat16, max_length=None if window else 40, window=window,
                                  rollback_slots=1)  # fmt: skip
    formula = QuantizedLayer.kv_bytes(
        2, 40, 3, HEAD_DIM, jnp.bfloat16, quantization=spec, span=window, rollback_slots=1
    )
    assert formula == layer.nbytes
    kind = "sliding_attention" if window else "full_attention"
    assert layer_bytes(kind, batch_size=2, seq_len=40, num_kv_heads=3, head_dim=HEAD_DIM, dtype=jnp.bfloat16,
                       window=window, rollback_slots=1, quantization=spec) == layer.nbytes  # fmt: skip


def test_int4_kivi_bytes_at_long_context():
    """int4 codes, f16 scales and zero points per 64, and a 128-token residual: under 0.3x of
    bfloat16 once the residual is a small part (SmolLM2's layout at 8k tokens)."""
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
    kivi = QuantSpec(nbits=4, axis_key=PER_CHANNEL, axis_value=PER_TOKEN)
    full = cache_bytes(config, 1, 8192, jnp.bfloat16)
    assert cache_bytes(config, 1, 8192, jnp.bfloat16, quantization=kivi) <= 0.3 * full


@pytest.mark.parametrize(
    "options, message, config_message",
    [
        ({"nbits": 3}, "int nbits must be one of", None),
        ({"format": "e4m3", "nbits": 4}, "fp8 format 'e4m3' stores 8 bits", None),
        ({"format": "nf4"}, "format must be one of", "format.*should be 'int', 'e4m3' or 'e5m2'"),
        ({"axis_key": 1}, "axis_key must be 0 .per token. or -1", None),
        ({"q_group_size": 0}, "q_group_size must be positive", None),
        ({"axis_value": -1, "residual_length": 6}, "multiple of q_group_size", None),
        ({"residual_length": -1}, "residual_length must be >= 0", None),
    ],
)
def test_bad_options_are_clear_errors(options, message, config_message):
    """The spec names the option and the fix; a config, which validates the spec itself, names the
    section and gives the spec's message (pydantic's own where the field's type says it: a format)."""
    with pytest.raises(ValueError, match=message):
        QuantSpec(**options)
    with pytest.raises(ValueError, match=f"(?s)quantization.*{config_message or message}"):
        CacheConfig.model_validate({"quantization": options})


def test_bad_layouts_are_clear_errors():
    config = {"num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8}
    with pytest.raises(ValueError, match="divides it"):
        Cache.from_config(config, 1, max_length=8, quantization=QuantSpec(q_group_size=3, residual_length=3))
    with pytest.raises(ValueError, match="full_attention='static'"):
        Cache.from_config(config, 1, full_attention="dynamic", quantization=QuantSpec(q_group_size=4))
    chunked = {**config, "layer_types": ["chunked_attention"], "attention_chunk_size": 4}
    with pytest.raises(ValueError, match="chunked_attention layers are not quantized"):
        Cache.from_config(chunked, 1, quantization=QuantSpec(q_group_size=4))
    cache = Cache.from_config(config, 1, max_length=8, quantization=QuantSpec(q_group_size=4))
    with pytest.raises(TypeError, match="dtype"):
        cache.update(0, jnp.ones((1, 2, 1, 8), jnp.bfloat16), jnp.ones((1, 2, 1, 8), jnp.bfloat16))
    cache, _ = cache.update(0, jnp.ones((1, 2, 6, 8)), jnp.ones((1, 2, 6, 8)))
    with pytest.raises(ValueError, match="capacity is 8; build the cache with max_length >= 9"):
        cache.update(0, jnp.ones((1, 2, 3, 8)), jnp.ones((1, 2, 3, 8)))


TINY = LlamaConfig(
    vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def test_generate_with_an_int8_cache_equals_full_precision():
    """A ragged batch through the jitted prefill and decode loop with an int8 cache whose
    residual flushes several times: the same greedy tokens as the float32 cache."""
    model = Llama(TINY, seed=3)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [6, 7]]
    full = generate(model, prompts, max_new_tokens=20)
    int8 = generate(
        model, prompts, max_new_tokens=20, quantization=QuantSpec(nbits=8, q_group_size=8, residual_length=4)
    )
    np.testing.assert_array_equal(int8.tokens, full.tokens)
    assert all(isinstance(layer, QuantizedLayer) for layer in int8.cache.layers)
    assert int8.cache_bytes < full.cache_bytes / 2


def test_cli_quantized_options_resolve_to_a_spec(tmp_path):
    from jaxkv.cli.main import build_parser, main

    def resolve(*argv):
        return resolve_config(build_parser().parse_args(["generate", *argv]))

    spec = resolve("--quantization", "--kv-bits", "2", "--kv-axis-key", "-1").cache.quantization
    assert spec == QuantSpec(nbits=2, axis_key=PER_CHANNEL)
    assert resolve("--quantization").cache.quantization == QuantSpec()
    assert resolve("--quantization", "--kv-format", "e5m2").cache.quantization.number_dtype == jnp.float8_e5m2
    config = tmp_path / "int4.yaml"
    config.write_text("cache:\n  quantization:\n    nbits: 4\n    axis_key: -1\n")
    assert resolve("--config", str(config)).cache.quantization == QuantSpec(nbits=4, axis_key=PER_CHANNEL)
    with pytest.raises(ValueError, match="add --quantization"):
        resolve("--kv-bits", "8")
    assert main(["generate", "--quantization", "--kv-format", "e4m3", "--kv-bits", "4"]) == 2


def test_perplexity_task_reads_the_corpus_through_the_cache():
    """The shipped text is there; perplexity fed in chunks through the cache equals one
    whole-window forward (float32), and an int8 cache stays within 1% of it."""
    from jaxkv.research.corpus import corpus_text
    from jaxkv.research.tasks import perplexity_through_cache

    text = corpus_text()
    assert len(text.split()) > 50_000 and "New South Wales" in text
    model = Llama(TINY, seed=5)
    window = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 33)).astype(np.int32)
    whole, _ = perplexity_through_cache(model, window, 32, {})
    chunked, _ = perplexity_through_cache(model, window, 8, {})
    np.testing.assert_allclose(chunked, whole, rtol=1e-5)
    int8 = QuantSpec(nbits=8, q_group_size=8, residual_length=8)
    quantized, _ = perplexity_through_cache(model, window, 8, {"quantization": int8})
    np.testing.assert_allclose(quantized, whole, rtol=1e-2)


def test_cli_generates_with_a_quantized_cache(capsys):
    from jaxkv.cli.main import main

    code = main(["generate", "--model", "smollm2", "--prompt", "What is 2+2?", "--max-new-tokens", "4",
                 "--quantization", "--kv-bits", "4", "--kv-axis-key", "-1"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.strip() and "cache" in out.err


def test_shipped_configs_validate():
    """configs/smollm2-int4.yaml is a KIVI int4 generate config; the perplexity grid
    (configs/experiments/perplexity.yaml) covers full precision and every quantized format."""
    from pathlib import Path

    from jaxkv.cli.generate import GenerateConfig
    from jaxkv.config import load_config
    from jaxkv.research.experiment import ExperimentConfig

    configs = Path(__file__).resolve().parents[2] / "configs"
    int4 = load_config(configs / "smollm2-int4.yaml", GenerateConfig).cache.quantization
    assert int4 == QuantSpec(nbits=4, axis_key=PER_CHANNEL, axis_value=PER_TOKEN)
    grid = load_config(configs / "experiments" / "perplexity.yaml", ExperimentConfig)
    assert any(c.kind == "full" for c in grid.caches)
    specs = {c.quantization for c in grid.caches if c.quantization}
    assert {(s.format, s.bits) for s in specs} == {("int", 8), ("int", 4), ("int", 2), ("e4m3", 8), ("e5m2", 8)}
