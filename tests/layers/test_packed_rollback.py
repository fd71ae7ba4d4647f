"""The serving engine's per-row linear-attention states roll back by position: a packed update
whose row starts below the row's length (after a verifying step rejected drafts) continues as
if the rejected tokens had never been fed.

Rounds of packed updates mix, in one update, rows verifying a token and its drafts (random
accepted counts, the next update starting after the accepted ones), rows decoding one token,
prefilling a chunk, taken over by a new request at position 0, and idle rows. On the layer with
the toy recurrence of ``test_linear``, outputs and final states equal the numpy oracle over each
row's kept tokens, and idle rows stay bit for bit; on a tiny Qwen3.5 with a paged cache, the
logits at the kept tokens and the final states equal a run fed only the kept tokens.
"""

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxkv.models.qwen3_5 import Qwen3_5, Qwen3_5Config

from jaxkv.batch import QUERY_BLOCK, PackedBatch
from jaxkv.layers.linear import LinearAttentionLayer, PackedStateLayer
from jaxkv.layers.paged import Paging, block_pages
from tests.layers.test_linear import CHANNELS, STATE_SHAPES, WEIGHT, WIDTH, conv_fn, oracle, step_fn
from tests.serving.test_engine import QWEN

DRAFTS = 3  # k: a verifying row feeds its token and up to k drafts; the layers keep R = k
ROWS, MAX_LEN = 4, 48


class Feed(NamedTuple):
    """One row's tokens in one update: positions ``start .. start + count - 1``, of which the first
    ``kept`` are the row's own tokens (rejected drafts follow); ``prefill``: a prefill chunk (else
    a decode slot: one token, or a token and its drafts). A feed from position 0 is a new request's
    (the row is taken over)."""

    start: int
    count: int
    kept: int
    prefill: bool


def plan_rounds(rng, num_rounds: int, prefill_chunks: int, max_chunk: int) -> tuple[list[list], np.ndarray]:
    """``num_rounds`` updates, each a ``Feed`` or None (idle) per row, then a closing round in which
    every row decodes one token (so each row's length is its kept count); and the rows' final
    kept counts ``[ROWS]``. At most ``prefill_chunks`` rows prefill up to ``max_chunk`` tokens per
    update; a row near ``MAX_LEN`` is taken over by a new request."""
    done, prompt = np.zeros(ROWS, int), rng.integers(3, 10, ROWS)
    rounds = []
    for _ in range(num_rounds):
        plan, prefills = [], 0
        for row in range(ROWS):
            if done[row] > MAX_LEN - 12:
                done[row], prompt[row] = 0, rng.integers(3, 10)
            if done[row] < prompt[row] and prefills < prefill_chunks:
                prefills += 1
                count = int(min(rng.integers(1, max_chunk + 1), prompt[row] - done[row]))
                plan.append(Feed(int(done[row]), count, count, True))
            elif done[row] < prompt[row] or rng.random() < 0.2:
                plan.append(None)
            else:
                drafts = int(rng.integers(0, DRAFTS + 1))
                plan.append(Feed(int(done[row]), 1 + drafts, 1 + int(rng.integers(0, drafts + 1)), False))
            done[row] += plan[-1].kept if plan[-1] else 0
        rounds.append(plan)
    rounds.append([Feed(int(start), 1, 1, False) for start in done])
    return rounds, done + 1


# ------------------------------------------------------------------------------------------------ the layer

TOKENS_PER_ROW = 8


@functools.partial(jax.jit, static_argnames="tokens_per_row")
def feed_packed(layer, conv_inputs, positions, token_rows, tokens_per_row):
    """One packed update of the layer's entry 0: ``conv_inputs`` ``[N, C]`` at ``positions`` ``[N]``
    of rows ``token_rows`` ``[N]``."""
    packed = PackedBatch(token_rows, {}, decode_tokens=0, tokens_per_row=tokens_per_row)
    return layer.update_state_packed_entry(
        0, conv_inputs[None], positions[None], functools.partial(conv_fn, WEIGHT), step_fn, packed
    )


def packed_state_layer(rollback_slots: int) -> PackedStateLayer:
    linear = LinearAttentionLayer.create(ROWS, CHANNELS, WIDTH, STATE_SHAPES, rollback_slots=rollback_slots)
    return PackedStateLayer(jax.tree.map(lambda leaf: leaf[None], linear))


def row_of(layer: PackedStateLayer, row: int):
    """Every leaf of engine row ``row`` (entry 0)."""
    return jax.tree.map(lambda leaf: leaf[0, row], layer.slots)


def noise(rng, count: int) -> np.ndarray:
    return rng.normal(size=(count, CHANNELS)).astype(np.float32)


@pytest.mark.parametrize("seed", range(3))
def test_layer_rows_restarting_below_their_length_equal_the_kept_tokens(seed):
    """Rounds of ragged rows verifying drafts (then restarting after their accepted ones),
    decoding, prefilling and taken over at position 0 in one packed update, the tokens in a
    random order with padding of any row among them, under jit: each row's outputs at its kept
    tokens and its final states equal the oracle over its kept tokens; rows without tokens in
    an update stay bit for bit."""
    rng = np.random.default_rng(seed)
    rounds, lengths = plan_rounds(rng, num_rounds=12, prefill_chunks=ROWS, max_chunk=TOKENS_PER_ROW)
    sequences = [noise(rng, MAX_LEN) for _ in range(ROWS)]
    layer, outputs = packed_state_layer(DRAFTS), [[] for _ in range(ROWS)]
    size = 2 * ROWS * TOKENS_PER_ROW  # twice what the rows bring: padding among the tokens
    for plan in rounds:
        conv_inputs, positions = np.zeros((size, CHANNELS), np.float32), np.full(size, -1, np.int32)
        token_rows, slots, free = rng.integers(0, ROWS, size).astype(np.int32), {}, rng.permutation(size)
        for row, feed in enumerate(plan):
            if feed is None:
                continue
            if feed.start == 0:
                sequences[row], outputs[row] = noise(rng, MAX_LEN), []
            slots[row], free = free[: feed.count], free[feed.count :]
            own = sequences[row][feed.start : feed.start + feed.kept]
            conv_inputs[slots[row]] = np.concatenate([own, noise(rng, feed.count - feed.kept)])
            positions[slots[row]], token_rows[slots[row]] = np.arange(feed.start, feed.start + feed.count), row
        before = layer
        layer, out = feed_packed(layer, *map(jnp.asarray, (conv_inputs, positions, token_rows)), TOKENS_PER_ROW)
        for row, feed in enumerate(plan):
            if feed is None:
                chex.assert_trees_all_equal(row_of(layer, row), row_of(before, row))
            else:
                outputs[row].append(np.asarray(out[0, slots[row][: feed.kept]]))
    np.testing.assert_array_equal(layer.lengths[0], lengths)
    states = jax.tree.map(lambda leaf: leaf[0], layer.slots).current_states()
    for row in range(ROWS):
        _, expected_out, expected_states = oracle(sequences[row][: lengths[row]])
        np.testing.assert_allclose(np.concatenate(outputs[row]), expected_out, atol=1e-5, rtol=1e-5)
        chex.assert_trees_all_close(tuple(np.asarray(s[row]) for s in states), expected_states, atol=1e-5)


def test_layer_rolling_back_past_its_slots_names_the_fix():
    """Eagerly, an update taking a row back further than its rollback_slots is an error naming
    the fix (under jit it is clamped: see ``PackedStateLayer``); within them the row continues
    from its first position."""
    layer = packed_state_layer(rollback_slots=1)
    inputs = jnp.asarray(noise(np.random.default_rng(0), 4))
    layer, _ = feed_packed(layer, inputs, jnp.arange(4), jnp.zeros(4, jnp.int32), 4)

    def update(positions):
        packed = PackedBatch(jnp.zeros(len(positions), jnp.int32), {}, decode_tokens=0, tokens_per_row=4)
        at = jnp.asarray(positions)[None]
        return layer.update_state_packed_entry(0, inputs[None, : at.shape[1]], at, functools.partial(conv_fn, WEIGHT),
                                               step_fn, packed)  # fmt: skip

    with pytest.raises(ValueError, match=r"undo 3 tokens but the layer can undo at most 1; build the cache with r"):
        update([1, 2])
    np.testing.assert_array_equal(update([3])[0].lengths[0], [4, 0, 0, 0])


# ------------------------------------------------------------------------------------------------ the model


def test_model_with_rollback_gives_the_logits_of_the_kept_tokens():
    """A tiny Qwen3.5 on a paged cache with rollback_slots = k, fed packed steps laid out as the
    engine lays them (a decode slot 1 + k wide per row first, then prefill chunks in query
    blocks): rows verifying drafts, decoding, prefilling and taken over, random accepted counts.
    The logits at every kept token and the final recurrent states equal a run fed only the kept
    tokens (the same shapes: the same compiled step)."""
    model = Qwen3_5(Qwen3_5Config(**QWEN))
    graphdef, state = nnx.split(model)
    width, prefill_chunks, pages = 1 + DRAFTS, 2, MAX_LEN // 4
    paging = Paging(page_size=4, num_pages=1 + ROWS * pages, max_length=MAX_LEN)
    # Row r's pages, then null pages (0) up to a whole block of pages attention reads at a time.
    table = np.zeros((ROWS, -(-pages // block_pages(4)) * block_pages(4)), np.int32)
    table[:, :pages] = np.arange(1, 1 + ROWS * pages).reshape(ROWS, pages)
    tables = {"full": jnp.asarray(table)}
    size = ROWS * width + prefill_chunks * QUERY_BLOCK

    @jax.jit
    def forward(state, cache, tokens, positions, token_rows):
        packed = PackedBatch(token_rows, tables, ROWS * width, QUERY_BLOCK, decode_width=width)
        return nnx.merge(graphdef, state)(tokens[None], positions[None], cache, packed=packed)

    rng = np.random.default_rng(0)
    rounds, lengths = plan_rounds(rng, num_rounds=14, prefill_chunks=prefill_chunks, max_chunk=QUERY_BLOCK - 6)
    vocab = QWEN["vocab_size"]
    sequences = [rng.integers(0, vocab, MAX_LEN) for _ in range(ROWS)]
    caches = {verifying: model.init_cache(ROWS, paging=paging, rollback_slots=DRAFTS) for verifying in (True, False)}
    for plan in rounds:
        token_rows, slots, chunks = np.repeat(np.arange(ROWS, dtype=np.int32), width), {}, 0
        token_rows = np.concatenate([token_rows, np.zeros(size - token_rows.size, np.int32)])
        tokens = {verifying: np.zeros(size, np.int32) for verifying in (True, False)}
        positions = {verifying: np.full(size, -1, np.int32) for verifying in (True, False)}
        for row, feed in enumerate(plan):
            if feed is None:
                continue
            if feed.start == 0:
                sequences[row] = rng.integers(0, vocab, MAX_LEN)
            slots[row] = row * width  # its decode slot
            if feed.prefill:
                slots[row], chunks = ROWS * width + QUERY_BLOCK * chunks, chunks + 1
                token_rows[slots[row] : slots[row] + QUERY_BLOCK] = row
            # Its own tokens, then rejected drafts: other tokens than its own.
            wrong = (np.arange(feed.count) >= feed.kept) * rng.integers(1, vocab, feed.count)
            fed = (sequences[row][feed.start : feed.start + feed.count] + wrong) % vocab
            for verifying, count in ((True, feed.count), (False, feed.kept)):
                tokens[verifying][slots[row] : slots[row] + count] = fed[:count]
                positions[verifying][slots[row] : slots[row] + count] = np.arange(feed.start, feed.start + count)
        logits = {}
        for verifying in (True, False):
            step = map(jnp.asarray, (tokens[verifying], positions[verifying], token_rows))
            out, caches[verifying] = forward(state, caches[verifying], *step)
            logits[verifying] = np.asarray(out[0])
        for row, feed in enumerate(plan):
            if feed is not None:
                kept = slice(slots[row], slots[row] + feed.kept)
                np.testing.assert_allclose(logits[True][kept], logits[False][kept], atol=1e-5, rtol=1e-5)
    for i, kind in enumerate(QWEN["layer_types"]):
        if kind == "linear_attention":
            got, want = (caches[verifying].layer(i).slots for verifying in (True, False))
            np.testing.assert_array_equal(got.lengths, lengths)
            np.testing.assert_array_equal(want.lengths, lengths)
            chex.assert_trees_all_close(got.current_states(), want.current_states(), atol=1e-5)
