"""What the tests share: small layers of each kind, random feed / rollback plans, tiny model
configs, the serving engine's arrival driver with its ``generate`` reference, and the ragged
rows of a paged pool the attention backends' tests read."""

import re

import numpy as np
from hypothesis import strategies as st

from jaxkv import ChunkedLayer, DynamicLayer, SlidingWindowLayer, StaticLayer
from jaxkv.decoding.generate import generate
from jaxkv.page_table import NULL_PAGE

VOCAB = 61
TINY_LLAMA = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip
TINY_GEMMA = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, sliding_window=4, query_pre_attn_scalar=8, max_position_embeddings=512,
    layer_types=("sliding_attention", "full_attention"),  # Gemma 3's mix, in a pattern short enough to compile fast
)  # fmt: skip
# A paragraph of English; seven copies run the real models past Gemma 3's 512-token window.
PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from those used for "
    "wine making. Books, which had been copied by hand for centuries, could now be produced quickly "
    "and cheaply, and within fifty years presses were working in more than two hundred European "
    "cities. Literacy spread, scholars shared their findings faster, and the Reformation carried "
    "its arguments across borders in printed pamphlets. "
)


def make_layer(kind, *, batch=1, heads=1, head_dim=1, span=4, max_length=24, rollback_slots=0):
    """A ``static``, ``dynamic``, ``sliding`` or ``chunked`` layer (``span``: window or chunk)."""
    if kind == "static":
        return StaticLayer.create(batch, heads, head_dim, max_length)
    if kind == "dynamic":
        return DynamicLayer.create(batch, heads, head_dim)
    cls = SlidingWindowLayer if kind == "sliding" else ChunkedLayer
    return cls.create(batch, heads, head_dim, span, rollback_slots=rollback_slots)


@st.composite
def feed_rollback_plans(draw, batch: int, budget: int, max_len: int, max_steps: int, rollback_draws: int = 1):
    """Steps ``("feed", width, counts)`` (row b takes ``counts[b]`` real tokens of ``width``, the
    rest padding) and ``("rollback", undo)`` (row b undoes ``undo[b]``).

    A rollback comes before a feed when ``rollback_draws`` coin flips all say so. Rollbacks
    without a feed in between share a budget, so a row undoes at most ``budget`` tokens below
    the longest it has been; rows never pass ``max_len`` tokens.
    """
    lengths, longest, steps = [0] * batch, [0] * batch, []
    for step in range(draw(st.integers(1, max_steps))):
        if step and budget and all(draw(st.booleans()) for _ in range(rollback_draws)):
            undo = [draw(st.integers(0, min(n, budget - (top - n)))) for n, top in zip(lengths, longest)]
            lengths = [n - u for n, u in zip(lengths, undo)]
            steps.append(("rollback", undo))
        width = draw(st.sampled_from([1, 1, 3, 8]))
        counts = [draw(st.integers(0, min(width, max_len - n))) for n in lengths]
        lengths = [n + c for n, c in zip(lengths, counts)]
        longest = [max(n, top) for n, top in zip(lengths, longest)]
        steps.append(("feed", width, counts))
    return steps


def greedy_reference(model, prompts, max_tokens: int) -> list[list[int]]:
    """``generate``'s greedy tokens for each prompt (rows are independent), no stop token."""
    result = generate(model, prompts, max_new_tokens=max_tokens, stop_tokens=())
    return [result.row(i) for i in range(len(prompts))]


def run_arrivals(engine, prompts, arrival_steps, max_tokens: int, **options) -> list[list[int]]:
    """Add prompt i to ``engine`` at step ``arrival_steps[i]`` (eos ignored), run to the end;
    each prompt's output tokens, in prompt order."""
    ids, step = {}, 0
    while len(ids) < len(prompts) or engine.has_unfinished():
        for i, arrival in enumerate(arrival_steps):
            if arrival == step:
                ids[i] = engine.add_request(prompts[i], max_tokens=max_tokens, ignore_eos=True, **options)
        engine.step()
        step += 1
    return [engine.sequences[ids[i]][0].output for i in range(len(prompts))]


# Collectives in a compiled module's text, and the shapes they return (each element of a tuple result).
COLLECTIVE = re.compile(r"= (.*?) (?:all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(?:-start)?\(")
SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def collective_shapes(text: str) -> list[tuple[int, ...]]:
    """Result shapes of every collective of a compiled module's text (each element of a tuple result)."""
    return [
        tuple(int(d) for d in dims.split(",") if d)
        for result in COLLECTIVE.findall(text)
        for dims in SHAPE.findall(result)
    ]


def stack_shapes(shape: tuple[int, ...], sharding) -> set[tuple[int, ...]]:
    """A stacked cache leaf's global and per-device shapes (``sharding``), whole and as one layer:
    what a collective that moves the leaf would return."""
    shapes = {tuple(shape), sharding.shard_shape(tuple(shape))}
    return shapes | {s[1:] for s in shapes}


# Four ragged rows of a paged pool (pages of 4 slots, up to 32 tokens), as the attention backend
# tests read them: row 1 holds nothing and decodes padding (position -1).
RAGGED_PAGE = 4
RAGGED_LENGTHS = np.array([9, 0, 16, 1], np.int32)
RAGGED_TOKEN_ROWS = np.array([2, 0, 3, 1], np.int32)  # the decode tokens' rows, not in row order


def ragged_tables(width: int) -> np.ndarray:
    """``[R, width]`` block tables of the ``RAGGED_LENGTHS`` rows: each row's pages (distinct, out of
    order), the null page past them."""
    tables = np.full((len(RAGGED_LENGTHS), width), NULL_PAGE, np.int32)
    tables[0, :3] = [5, 2, 9]
    tables[2, :4] = [1, 12, 7, 3]
    tables[3, :1] = [15]
    return tables

