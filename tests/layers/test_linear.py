"""Linear-attention (state) layers and hybrid layers: incremental equals whole-sequence,
rollback then re-feed equals never having fed, padding never changes a state, the state
does not grow with length, and the container builds and routes them.

The recurrence under test is a toy with two states: a decayed sum of outer products
``S <- 0.9 S + k v^T`` read by k (the shape of a linear-attention state) and a running
sum of k (a second, differently shaped state). The oracle runs each row's whole sequence
in numpy without any cache.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import Cache, HybridLayer, LinearAttentionLayer, SlidingWindowLayer, StaticLayer, attention
from jaxkv.memory import cache_bytes, layer_bytes
from jaxkv.models.architectures import QWEN3_NEXT_80B
from tests.oracle import full_attention
from tests.cases import feed_rollback_plans

HEADS, KEY_DIM, VALUE_DIM, WIDTH = 2, 2, 3, 3
CHANNELS = HEADS * (KEY_DIM + VALUE_DIM)
STATE_SHAPES = ((HEADS, KEY_DIM, VALUE_DIM), (HEADS,))
KV_HEADS, HEAD_DIM, WINDOW, MAX_LEN = 1, 4, 4, 24
KINDS = ("linear_attention", "conv", "hybrid", "hybrid_sliding")
WEIGHT = np.random.default_rng(1).normal(size=(CHANNELS, WIDTH)).astype(np.float32)


def make_layer(kind, batch, rollback_slots):
    shapes = () if kind == "conv" else STATE_SHAPES
    linear = LinearAttentionLayer.create(batch, CHANNELS, WIDTH, shapes, rollback_slots=rollback_slots)
    if kind == "hybrid":
        return HybridLayer(linear, StaticLayer.create(batch, KV_HEADS, HEAD_DIM, MAX_LEN))
    if kind == "hybrid_sliding":
        return HybridLayer(
            linear, SlidingWindowLayer.create(batch, KV_HEADS, HEAD_DIM, WINDOW, rollback_slots=rollback_slots)
        )
    return linear


def conv_fn(weight, windows):
    """``windows`` ``[B, T, C, K]`` -> keys ``[B, T, H, Dk]`` and values ``[B, T, H, Dv]``."""
    out = jax.nn.silu(jnp.einsum("btck,ck->btc", windows, weight))
    keys, values = jnp.split(out, [HEADS * KEY_DIM], axis=-1)
    return keys.reshape(*keys.shape[:2], HEADS, KEY_DIM), values.reshape(*values.shape[:2], HEADS, VALUE_DIM)


def step_fn(states, x):
    outer, total = states
    k, v = x
    outer = 0.9 * outer + k[..., :, None] * v[..., None, :]
    return (outer, total + k.sum(-1)), jnp.einsum("bhk,bhkv->bhv", k, outer)


def feed(layer, conv_inputs, q, k, v, positions, weight, *, kind):
    """One forward of a layer: the state update, and attention for the hybrid kinds."""
    recurrence = None if kind == "conv" else step_fn
    layer, outputs = layer.update_state(conv_inputs, positions, functools.partial(conv_fn, weight), recurrence)
    if kind.startswith("hybrid"):
        layer, kv = layer.update(k, v, positions)
        outputs = (outputs, attention(q, kv, positions))
    return layer, outputs


# One function per kind, made once: jit reuses its compilations across hypothesis examples.
FEEDS = {kind: functools.partial(feed, kind=kind) for kind in KINDS}


def oracle(inputs):
    """One row's whole sequence ``[L, C]`` -> (conv keys, values), outputs, final states."""
    padded = np.concatenate([np.zeros((WIDTH - 1, CHANNELS)), np.asarray(inputs, np.float64)])
    conv = sum(padded[j : j + len(inputs)] * WEIGHT[:, j].astype(np.float64) for j in range(WIDTH))
    conv = conv / (1 + np.exp(-conv))
    keys = conv[:, : HEADS * KEY_DIM].reshape(-1, HEADS, KEY_DIM)
    values = conv[:, HEADS * KEY_DIM :].reshape(-1, HEADS, VALUE_DIM)
    outer, total, outputs = np.zeros(STATE_SHAPES[0]), np.zeros(STATE_SHAPES[1]), []
    for k, v in zip(keys, values):
        outer = 0.9 * outer + k[:, :, None] * v[:, None, :]
        total = total + k.sum(-1)
        outputs.append(np.einsum("hk,hkv->hv", k, outer))
    return (keys, values), np.asarray(outputs).reshape(-1, HEADS, VALUE_DIM), (outer, total)


@st.composite
def scenarios(draw):
    """A layer kind's batch, rollback budget, and a plan of feed / rollback steps per row."""
    batch = 3  # one shape per width, so the jitted variant compiles each width once
    rollback_slots = draw(st.integers(0, 2))
    # A row undoes at most R tokens below the longest it has been.
    return batch, rollback_slots, draw(feed_rollback_plans(batch, rollback_slots, MAX_LEN, max_steps=4))


class IncrementalEqualsWholeSequence(chex.TestCase):
    """Random chunk sizes, ragged rows (padding at the end or the start of a row's slot
    range) and rollbacks: every real token's output and every row's final state equal the
    oracle over the row's current sequence, float32, within 1e-4 (relative for the state)."""

    def run_scenario(self, kind, scenario):
        batch, rollback_slots, steps = scenario
        rng = np.random.default_rng(0)
        seq_x = np.zeros((batch, MAX_LEN, CHANNELS), np.float32)
        seq_q = np.zeros((batch, KV_HEADS, MAX_LEN, HEAD_DIM), np.float32)
        seq_k, seq_v = np.zeros_like(seq_q), np.zeros_like(seq_q)
        layer = make_layer(kind, batch, rollback_slots)
        lengths = np.zeros(batch, int)
        step = self.variant(FEEDS[kind])
        for action, *args in steps:
            if action == "rollback":
                layer = layer.rollback(jnp.asarray(args[0]))
                lengths -= np.asarray(args[0])
                continue
            width, counts = args
            # Padding carries large garbage (any leak shows); odd rows pad before their tokens.
            x = rng.normal(size=(batch, width, CHANNELS)).astype(np.float32) * 100
            q, k, v = (rng.normal(size=(batch, KV_HEADS, width, HEAD_DIM)).astype(np.float32) * 100 for _ in range(3))
            positions = np.full((batch, width), -1, np.int32)
            for row, count in enumerate(counts):
                slots = np.arange(width - count, width) if row % 2 else np.arange(count)
                pos = lengths[row] + np.arange(count)
                positions[row, slots] = pos
                x[row, slots] = rng.normal(size=(count, CHANNELS))
                seq_x[row, pos] = x[row, slots]
                for arr, seq in ((q, seq_q), (k, seq_k), (v, seq_v)):
                    arr[row, :, slots] = rng.normal(size=(count, KV_HEADS, HEAD_DIM))
                    seq[row][:, pos] = arr[row, :, slots].transpose(1, 0, 2)
            layer, outputs = step(layer, *map(jnp.asarray, (x, q, k, v, positions, WEIGHT)))
            linear = layer.linear if isinstance(layer, HybridLayer) else layer
            for row, count in enumerate(counts):
                end = lengths[row] + count
                slots = np.arange(width - count, width) if row % 2 else np.arange(count)
                conv, want, states = oracle(seq_x[row, :end])
                if kind == "conv":
                    for got, expected in zip(outputs, conv):
                        np.testing.assert_allclose(np.asarray(got)[row, slots], expected[lengths[row] :], atol=1e-4)
                    continue
                recurrent = outputs[0] if kind.startswith("hybrid") else outputs
                np.testing.assert_allclose(
                    np.asarray(recurrent)[row, slots], want[lengths[row] :], rtol=1e-4, atol=1e-4
                )
                padding = np.setdiff1d(np.arange(width), slots)
                np.testing.assert_array_equal(np.asarray(recurrent)[row, padding], 0.0)
                for got, expected in zip(linear.current_states(), states):
                    np.testing.assert_allclose(np.asarray(got)[row], expected, rtol=1e-4, atol=1e-4)
                if kind.startswith("hybrid") and count:
                    window = {"window": WINDOW} if kind == "hybrid_sliding" else {}
                    att = full_attention(seq_q[row][:, :end], seq_k[row][:, :end], seq_v[row][:, :end], **window)
                    got = np.asarray(outputs[1])[row][:, slots]
                    np.testing.assert_allclose(got, att[:, lengths[row] :], atol=1e-4)
            lengths += np.asarray(counts)
            np.testing.assert_array_equal(np.asarray(layer.lengths), lengths)

    @chex.variants(with_jit=True, without_jit=True)
    @settings(max_examples=12)  # an eager scan compiles per call: about 3 examples per kind
    @given(st.sampled_from(KINDS), scenarios())
    def test_every_state_kind(self, kind, scenario):
        self.run_scenario(kind, scenario)


def random_inputs(rng, batch, length):
    x = rng.normal(size=(batch, length, CHANNELS)).astype(np.float32)
    q, k, v = (rng.normal(size=(batch, KV_HEADS, length, HEAD_DIM)).astype(np.float32) for _ in range(3))
    return [jnp.asarray(a) for a in (x, q, k, v)]


def positions_from(lengths, width):
    return jnp.asarray(lengths)[:, None] + jnp.arange(width)[None, :]


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_then_refeed_equals_never_fed(kind):
    """Prefix, then as many draft tokens as the budget allows, rollback, then the real
    continuation: the same states, lengths and outputs as prefix then continuation, with
    the rollback run eagerly and under jit."""
    undo = 2
    rng = np.random.default_rng(0)
    prefix, draft, real = random_inputs(rng, 2, 5), random_inputs(rng, 2, undo), random_inputs(rng, 2, 2)
    run = jax.jit(FEEDS[kind])
    weight = jnp.asarray(WEIGHT)
    linear = (lambda layer: layer.linear) if kind.startswith("hybrid") else (lambda layer: layer)
    layer, _ = run(make_layer(kind, 2, rollback_slots=undo), *prefix, positions_from([0, 0], 5), weight)
    expected, expected_out = run(layer, *real, positions_from([5, 5], 2), weight)
    drafted, _ = run(layer, *draft, positions_from([5, 5], undo), weight)
    for rollback in (lambda layer, n: layer.rollback(n), jax.jit(lambda layer, n: layer.rollback(n))):
        got, got_out = run(rollback(drafted, undo), *real, positions_from([5, 5], 2), weight)
        chex.assert_trees_all_close(got_out, expected_out, atol=1e-6)
        chex.assert_trees_all_close(linear(got).current_states(), linear(expected).current_states(), atol=1e-6)
        np.testing.assert_array_equal(got.lengths, expected.lengths)


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_beyond_budget(kind):
    """Eagerly an error naming the fix; under jit clamped to the budget (documented)."""
    layer = make_layer(kind, 1, rollback_slots=2)
    layer, _ = jax.jit(FEEDS[kind])(
        layer, *random_inputs(np.random.default_rng(0), 1, 6), positions_from([0], 6), WEIGHT
    )
    assert layer.max_rollback == 2
    with pytest.raises(ValueError, match=r"rollback_slots >= 3"):
        layer.rollback(3)
    np.testing.assert_array_equal(jax.jit(lambda layer, n: layer.rollback(n))(layer, 3).lengths, [4])
    # Two rollbacks without a feed share the budget: the second may undo only what is left.
    with pytest.raises(ValueError, match="row 0 can undo only 1 more token"):
        layer.rollback(1).rollback(2)
    np.testing.assert_array_equal(jax.jit(lambda layer, n: layer.rollback(1).rollback(n))(layer, 2).lengths, [4])
    cache = Cache.from_layer_types(
        [kind], batch_size=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_length=MAX_LEN, sliding_window=WINDOW,
        conv_width=WIDTH, conv_channels=CHANNELS, state_shapes=STATE_SHAPES,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"rollback_slots >= 1 \(a linear-attention layer"):
        cache.rollback(1)


@pytest.mark.parametrize("kind", ("linear_attention", "conv"))
def test_state_bytes_do_not_grow_with_length(kind):
    """The same bytes after 2 tokens as after 600, equal to the memory formula."""
    layer = make_layer(kind, 2, rollback_slots=1)
    before = layer.nbytes
    shapes = () if kind == "conv" else STATE_SHAPES
    formula = layer_bytes(
        kind, batch_size=2, seq_len=600, num_kv_heads=0, head_dim=0, dtype=jnp.float32,
        conv_width=WIDTH, conv_channels=CHANNELS, state_shapes=shapes, rollback_slots=1,
    )  # fmt: skip
    step = jax.jit(FEEDS[kind])
    rng = np.random.default_rng(0)
    for start in (0, 2, 300):
        width = 2 if start == 0 else 298 if start == 2 else 300
        x, q, k, v = random_inputs(rng, 2, width)
        layer, _ = step(layer, x, q, k, v, positions_from([start, start], width), jnp.asarray(WEIGHT))
        assert layer.nbytes == before == formula
    np.testing.assert_array_equal(layer.lengths, [600, 600])


def test_padding_never_changes_a_row():
    """A row fed only padding keeps its state, its conv inputs and its length bit for bit."""
    step = jax.jit(FEEDS["linear_attention"])
    layer, _ = step(make_layer("linear_attention", 2, 1), *random_inputs(np.random.default_rng(0), 2, 4),
                    positions_from([0, 0], 4), WEIGHT)  # fmt: skip
    positions = jnp.asarray([[4, 5, 6], [-1, -1, -1]])
    after, outputs = step(layer, *random_inputs(np.random.default_rng(1), 2, 3), positions, WEIGHT)
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[1], after), jax.tree.map(lambda a: a[1], layer))
    np.testing.assert_array_equal(outputs[1], 0.0)
    np.testing.assert_array_equal(after.lengths, [7, 4])


@pytest.mark.parametrize("full_attention", ["static", "dynamic"])
def test_container_builds_routes_and_gathers_rows(full_attention):
    """``layer_types`` with every state kind: the right class per layer, ``update_state``
    and ``update`` routed by layer index, growing attention halves reserved, rows
    reordered in every leaf."""
    types = ["linear_attention", "conv", "hybrid", "hybrid_sliding", "full_attention"]
    cache = Cache.from_layer_types(
        types, batch_size=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_length=MAX_LEN, sliding_window=WINDOW,
        conv_width=WIDTH, conv_channels=CHANNELS, state_shapes=STATE_SHAPES, rollback_slots=1,
        full_attention=full_attention,
    ).reserve(3)  # fmt: skip
    full = "StaticLayer" if full_attention == "static" else "DynamicLayer"
    classes = [type(layer).__name__ for layer in cache.layers]
    assert classes == ["LinearAttentionLayer", "LinearAttentionLayer", "HybridLayer", "HybridLayer", full]
    assert type(cache.layer(2).attention).__name__ == full
    assert isinstance(cache.layer(3).attention, SlidingWindowLayer) and cache.max_rollback == 1
    x, _, k, v = random_inputs(np.random.default_rng(0), 2, 3)
    positions = cache.next_positions(3, num_new=[3, 2])
    conv = functools.partial(conv_fn, jnp.asarray(WEIGHT))
    for i, kind in enumerate(types):
        if kind != "full_attention":
            cache, _ = cache.update_state(i, x, positions, conv, None if kind == "conv" else step_fn)
        if kind.startswith("hybrid") or kind == "full_attention":
            cache, _ = cache.update(i, k, v, positions)
    np.testing.assert_array_equal(cache.lengths, [3, 2])
    swapped = cache.reorder(jnp.asarray([1, 0]))
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[:, ::-1], swapped.groups), cache.groups)
    assert cache.reset().lengths.tolist() == [0, 0]


def test_from_config_reads_a_gated_deltanet_config():
    """Qwen3.5 / Qwen3-Next names give the conv width, channels and ``[H_v, D_k, D_v]`` state."""
    config = {
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 6,
    }  # fmt: skip
    layer = Cache.from_config(config, 3, max_length=16).layer(0)
    chex.assert_shape(layer.conv_inputs, (3, 2 * 2 * 8 + 4 * 6, 3))
    chex.assert_shape(layer.states, ((3, 1, 4, 8, 6),))


def test_bad_inputs_name_the_problem():
    layer = make_layer("linear_attention", 2, 0)
    x = jnp.zeros((2, 3, CHANNELS))
    conv = functools.partial(conv_fn, jnp.asarray(WEIGHT))
    with pytest.raises(ValueError, match=r"conv_inputs has shape \(2, 3, 5\), expected \[B, T, C\]"):
        layer.update_state(x[..., :5], positions_from([0, 0], 3), conv, step_fn)
    with pytest.raises(TypeError, match="dtype=bfloat16"):
        layer.update_state(x.astype(jnp.bfloat16), positions_from([0, 0], 3), conv, step_fn)
    with pytest.raises(ValueError, match="row 1 has length 0, so its new tokens must sit at positions 0"):
        layer.update_state(x, jnp.asarray([[0, 1, 2], [1, 2, 3]]), conv, step_fn)
    with pytest.raises(ValueError, match="needs state_shapes"):
        Cache.from_layer_types(
            ["linear_attention"], batch_size=1, num_kv_heads=1, head_dim=4, conv_width=2, conv_channels=4
        )
    with pytest.raises(ValueError, match="need conv_width and conv_channels"):
        Cache.from_layer_types(["conv"], batch_size=1, num_kv_heads=1, head_dim=4)


def test_hybrid_model_state_bytes_do_not_grow_with_length():
    """Qwen3-Next's 36 linear layers cost the same at 4k and 32k tokens (the README table's
    growth is its 12 attention layers'), and ``cache_bytes`` agrees with the layer formula."""
    linear_only = {**QWEN3_NEXT_80B, "layer_types": ["linear_attention"] * 36, "num_hidden_layers": 36}
    per_layer = layer_bytes(
        "linear_attention", batch_size=1, seq_len=0, num_kv_heads=0, head_dim=0, dtype=jnp.bfloat16,
        conv_width=4, conv_channels=2 * 16 * 128 + 32 * 128, state_shapes=((32, 128, 128),),
    )  # fmt: skip
    assert cache_bytes(linear_only, 1, 4096) == cache_bytes(linear_only, 1, 32768) == 36 * per_layer
    attention_growth = cache_bytes(QWEN3_NEXT_80B, 1, 32768) - cache_bytes(QWEN3_NEXT_80B, 1, 4096)
    assert attention_growth == 12 * 2 * (32768 - 4096) * 2 * 256 * 2  # 12 layers, K+V, 2 heads of 256, bf16
