"""The one compiled serving step: a packed batch of prefill chunks and decode tokens through
the model over paged K/V, then a token drawn for each row that asked for one.

Shapes are static per bucket: ``N`` packed tokens (a few power-of-two buckets up to the
token budget), ``R`` block-table rows (the engine's row count), ``W`` table columns, ``K``
page copies. The page pools are donated and updated in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxkv.cache import Cache
from jaxkv.decoding.sampling import RowSampling, sample_rows
from jaxkv.layers.paged import PagedLayer
from jaxkv.protocol import PackedRowsLayer


@struct.dataclass
class StepInputs:
    """One step's packed batch.

    ``tokens``, ``positions``, ``token_rows`` ``[N]``: the packed tokens, their absolute
    positions (-1: padding) and block-table rows. ``lengths`` ``[R]``: each row's length after
    the step. ``block_tables``: ``[R, W]`` per pool name ('full', 'sliding'). ``copies``:
    ``[K, 2]`` (source, destination) pages per pool, copied before anything is written
    (copy-on-write of a forked sample's last prompt page; padding copies the null page onto
    itself). ``sample_index`` ``[R]``: where each row's last token sits in the packed batch.
    ``seeds``, ``counters`` ``[R]``: each row draws with the key of (request seed, sample
    index, tokens drawn so far), so a sample's tokens do not depend on what it was batched
    with or on a preemption. ``sampling``: per-row parameters.
    """

    tokens: jax.Array
    positions: jax.Array
    token_rows: jax.Array
    lengths: jax.Array
    block_tables: dict
    copies: dict
    sample_index: jax.Array
    seeds: jax.Array
    sample_numbers: jax.Array
    counters: jax.Array
    sampling: RowSampling


@struct.dataclass
class StepOutputs:
    """Per row ``[R]``: the drawn token and its log-probability, and the top ``M`` alternatives ``[R, M]``."""

    tokens: jax.Array
    logprobs: jax.Array
    top_tokens: jax.Array
    top_logprobs: jax.Array


def pool_of(layer: PagedLayer) -> str:
    """The pool (and block table) a paged layer group reads: 'sliding' for a window, else 'full'."""
    return "full" if layer.window is None else "sliding"


def routed(cache: Cache, inputs: StepInputs, single_tokens: int) -> Cache:
    """The cache with the step's page copies applied and its block tables and token rows in
    every group (per-row groups, recurrent states or evicted K/V, take the token rows only)."""
    tokens_per_row = max(1, inputs.tokens.shape[0] - single_tokens)  # a prefill chunk fills at most the rest
    groups = []
    for group in cache.groups:
        if isinstance(group, PackedRowsLayer):
            groups.append(group.with_step(inputs.token_rows, tokens_per_row))
            continue
        pool = pool_of(group)
        source, destination = inputs.copies[pool][:, 0], inputs.copies[pool][:, 1]

        def copied(stack):
            return jax.tree.map(lambda leaf: leaf.at[:, destination].set(leaf[:, source]), stack)

        group = group.replace(key_pages=copied(group.key_pages), value_pages=copied(group.value_pages))
        groups.append(group.with_step(inputs.block_tables[pool], inputs.token_rows, inputs.lengths, single_tokens))
    return cache.replace(groups=tuple(groups))


def persistent(kept: PagedLayer | PackedRowsLayer, stepped: PagedLayer | PackedRowsLayer):
    """What carries over to the next step: ``stepped``'s pages or per-row slots, with ``kept``'s
    per-step fields (their shapes are the engine's, whatever this step's bucket)."""
    if isinstance(kept, PackedRowsLayer):
        return kept.replace(slots=stepped.slots)
    return kept.replace(key_pages=stepped.key_pages, value_pages=stepped.value_pages)


def row_keys(inputs: StepInputs) -> jax.Array:
    """One key per row from (seed, sample number, tokens drawn so far)."""

    def key(seed, sample_number, counter):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sample_number), counter)

    return jax.vmap(key)(inputs.seeds, inputs.sample_numbers, inputs.counters)


def serving_step(
    graphdef, state, cache: Cache, inputs: StepInputs, num_top: int, single_tokens: int
) -> tuple[StepOutputs, Cache]:
    """Run the packed batch (its first ``single_tokens`` are decode slots, the rest prefill chunks
    in query blocks; ``PagedLayer.with_step``), then draw each row's next token from the logits at
    its ``sample_index`` (rows that draw nothing this step are ignored by the host)."""
    model = nnx.merge(graphdef, state)
    logits, stepped = model(
        inputs.tokens[None],
        inputs.positions[None],
        routed(cache, inputs, single_tokens),
        logits_index=inputs.sample_index[None],
    )
    cache = cache.replace(groups=tuple(persistent(kept, new) for kept, new in zip(cache.groups, stepped.groups)))
    logits = logits[0]  # [R, V]
    tokens = sample_rows(logits, row_keys(inputs), inputs.sampling)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_logprobs, top_tokens = jax.lax.top_k(logprobs, num_top)
    return StepOutputs(tokens, chosen, top_tokens.astype(jnp.int32), top_logprobs), cache


compiled_step = jax.jit(
    serving_step, static_argnames=("graphdef", "num_top", "single_tokens"), donate_argnames=("cache",)
)
