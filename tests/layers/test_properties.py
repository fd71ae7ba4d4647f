"""Incremental updates in random chunk sizes equal attention over the whole sequence.

For every layer type: a batch of rows of different lengths is fed as a prefill, then any
mix of single- and multi-token updates (rows take different numbers of real tokens per
update, the rest is padding), with rollbacks and re-feeds in between. Every real query's
attention output must equal full causal (windowed / chunked) attention over the row's
current sequence, float32, max abs error <= 1e-5, under jit and eagerly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import attention
from tests.cases import feed_rollback_plans, make_layer
from tests.oracle import full_attention

HEAD_DIM = 4
MAX_LEN = 24


def mask_rule(kind, span):
    return {"sliding": {"window": span}, "chunked": {"chunk": span}}.get(kind, {})


def update_and_attend(layer, q, k, v, positions, block_size=256):
    layer, kv = layer.update(k, v, positions)
    return layer, attention(q, kv, positions, block_size=block_size)


@st.composite
def scenarios(draw):
    """A batch, head layout, span, and a plan of feed / rollback steps per row."""
    # Few distinct shapes, so the jitted variant reuses its compilations across examples.
    batch = draw(st.sampled_from([1, 3]))
    num_kv_heads, group = draw(st.sampled_from([(1, 2), (2, 1), (2, 2)]))
    span = draw(st.integers(1, 6))
    rollback_slots = draw(st.integers(0, 2))
    # A ring row undoes at most R + 1 tokens below the longest it has been (a row that took no
    # token since its last rollback shares that rollback's budget).
    steps = draw(feed_rollback_plans(batch, rollback_slots + 1, MAX_LEN, max_steps=6, rollback_draws=2))
    return batch, num_kv_heads, group, span, rollback_slots, steps


# The property's cases: kind of layer and attention block size (4: blocks of 4 slots, read only up
# to the filled length, with an online softmax).
CASES = {
    "static": ("static", 256), "dynamic": ("dynamic", 256), "sliding_window": ("sliding", 256),
    "chunked": ("chunked", 256), "static_blocked_attention": ("static", 4), "dynamic_blocked_attention": ("dynamic", 4),
}  # fmt: skip
# Eagerly, every op dispatches and compiles on its own for each new shape: a random plan costs
# about 3x its jitted run (the chunked case took 24-48 s of the file's 150). What the eager run
# adds is the layers' code outside a trace (concrete values), which a few plans exercise; the
# random plans themselves are the jitted run's, at the profile's count.
EAGER_EXAMPLES = 4
jitted_update_and_attend = jax.jit(update_and_attend, static_argnames="block_size")


def run_scenario(kind, scenario, step, block_size):
    """Feed and roll back ``scenario``'s plan through ``step`` (``update_and_attend``, jitted
    or not); every real query's output must equal full attention over its row's sequence."""
    batch, num_kv_heads, group, span, rollback_slots, steps = scenario
    num_heads = num_kv_heads * group
    rng = np.random.default_rng(0)
    # The row's current sequence: re-fed positions overwrite rolled-back ones.
    seq_q = np.zeros((batch, num_heads, MAX_LEN, HEAD_DIM), np.float32)
    seq_k = np.zeros((batch, num_kv_heads, MAX_LEN, HEAD_DIM), np.float32)
    seq_v = np.zeros_like(seq_k)
    layer = make_layer(
        kind, batch=batch, heads=num_kv_heads, head_dim=HEAD_DIM, span=span, max_length=MAX_LEN,
        rollback_slots=rollback_slots,
    )  # fmt: skip
    lengths = np.zeros(batch, int)
    for action, *args in steps:
        if action == "rollback":
            layer = layer.rollback(jnp.asarray(args[0]))
            lengths -= np.asarray(args[0])
            continue
        width, counts = args
        # Padding tokens carry large garbage: any leak shows up in the output.
        q = rng.normal(size=(batch, num_heads, width, HEAD_DIM)).astype(np.float32) * 100
        k = rng.normal(size=(batch, num_kv_heads, width, HEAD_DIM)).astype(np.float32) * 100
        v = rng.normal(size=(batch, num_kv_heads, width, HEAD_DIM)).astype(np.float32) * 100
        positions = np.full((batch, width), -1, np.int32)
        for row, count in enumerate(counts):
            pos = lengths[row] + np.arange(count)
            positions[row, :count] = pos
            for arr, seq in ((q, seq_q), (k, seq_k), (v, seq_v)):
                arr[row, :, :count] = rng.normal(size=arr[row, :, :count].shape)
                seq[row][:, pos] = arr[row, :, :count]
        if kind == "dynamic":
            layer = layer.reserve(width)
        layer, out = step(
            layer, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions), block_size=block_size
        )
        out = np.asarray(out)
        for row, count in enumerate(counts):
            end = lengths[row] + count
            if count:
                want = full_attention(
                    seq_q[row][:, :end], seq_k[row][:, :end], seq_v[row][:, :end], **mask_rule(kind, span)
                )[:, lengths[row] :]
                np.testing.assert_allclose(out[row, :, :count], want, atol=1e-5, rtol=0)
            # Padding queries see nothing and give exact zeros.
            np.testing.assert_array_equal(out[row, :, count:], 0.0)
        lengths += np.asarray(counts)
        np.testing.assert_array_equal(np.asarray(layer.lengths), lengths)


@pytest.mark.parametrize("case", CASES)
@given(scenario=scenarios())
def test_incremental_equals_full_attention__with_jit(case, scenario):
    kind, block_size = CASES[case]
    run_scenario(kind, scenario, jitted_update_and_attend, block_size)


@pytest.mark.parametrize("case", CASES)
@settings(max_examples=EAGER_EXAMPLES)
@given(scenario=scenarios())
def test_incremental_equals_full_attention__without_jit(case, scenario):
    kind, block_size = CASES[case]
    run_scenario(kind, scenario, update_and_attend, block_size)
