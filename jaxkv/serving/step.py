"""The compiled serving step: a packed batch of prefill chunks and decode tokens through the
model over paged K/V, then a token drawn for each row that asked for one.

Shapes are static per step shape: ``N`` packed tokens (``S`` decode slots, then a prefill
bucket up to the token budget), ``S`` sample slots (one per scheduled chunk), ``R`` rows (the
engine's ``max_num_seqs``: block-table rows), ``W`` block-table columns. The
cache is donated and updated in place; the step's metadata (``jaxkv.batch.PackedBatch``)
travels beside it, never in it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.batch import PackedBatch, PagedStorage
from jaxkv.cache import Cache
from jaxkv.decoding.sampling import RowSampling, sample_rows
from jaxkv.protocol import has, pytree_class


@pytree_class
class StepInputs:
    """One step's packed batch and each row's draw.

    ``tokens`` ``[N]`` int32: the packed tokens; ``positions`` ``[N]`` int32: their absolute
    positions (-1: padding); ``packed``: each token's row and the block tables (``PackedBatch``);
    ``sample_index`` ``[S]`` int32: where each sample slot's chunk has its last token in the
    packed batch. ``num_logprobs`` ``[S]`` int32: the top alternatives each slot asks for (none:
    no top-k is computed). ``seeds`` ``[S]`` uint32, ``sample_numbers``, ``counters`` ``[S]``
    int32: each slot draws with the key of (request seed, sequence index, tokens drawn so far),
    so a sequence's tokens do not depend on what it was batched with or on a preemption.
    ``sampling``: per-slot parameters ``[S]``.
    """

    tokens: jax.Array
    positions: jax.Array
    packed: PackedBatch
    sample_index: jax.Array
    num_logprobs: jax.Array
    seeds: jax.Array
    sample_numbers: jax.Array
    counters: jax.Array
    sampling: RowSampling


@pytree_class
class StepOutputs:
    """Per sample slot ``[S]``: the drawn token (int32) and its log-probability (float32), and
    the top ``M`` alternatives ``[S, M]`` (int32 ids, float32 log-probabilities)."""

    tokens: jax.Array
    logprobs: jax.Array
    top_tokens: jax.Array
    top_logprobs: jax.Array


def _row_keys(inputs: StepInputs) -> jax.Array:
    """One key per sample slot from (seed, sequence number, tokens drawn so far)."""

    def key(seed, sample_number, counter):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sample_number), counter)

    return jax.vmap(key)(inputs.seeds, inputs.sample_numbers, inputs.counters)


def serving_step(graphdef, state, cache: Cache, inputs: StepInputs, num_top: int) -> tuple[StepOutputs, Cache]:
    """Run the packed batch, then draw each sample slot's next token from the logits at its
    ``sample_index`` (slots that draw nothing this step are ignored by the host)."""
    model = nnx.merge(graphdef, state)
    positions = inputs.positions[None]
    logits, cache = model(
        inputs.tokens[None], positions, cache, logits_index=inputs.sample_index[None], packed=inputs.packed
    )
    logits = logits[0]  # [S, V]
    tokens = sample_rows(logits, _row_keys(inputs), inputs.sampling)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]

    def top():
        top_logprobs, top_tokens = jax.lax.top_k(logprobs, num_top)
        return top_tokens.astype(jnp.int32), top_logprobs

    def none():  # no row asked for alternatives: skip the top-k over the vocabulary
        shape = (logits.shape[0], num_top)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)

    top_tokens, top_logprobs = jax.lax.cond(jnp.any(inputs.num_logprobs > 0), top, none)
    return StepOutputs(tokens, chosen, top_tokens, top_logprobs), cache


compiled_step = jax.jit(serving_step, static_argnames=("graphdef", "num_top"), donate_argnames=("cache",))

copy_pages = jax.jit(lambda cache, copies: cache.with_page_copies(copies), donate_argnums=0)
"""The cache with a fork's pages copied (``Cache.with_page_copies``), run only in a step that forks."""


def page_formats(cache: Cache) -> list[tuple[str, list[jax.ShapeDtypeStruct]]]:
    """Per paged group of ``cache`` (in order): its pool name and the shape of one page of each of its
    leaves, ``[L, page_size, H_kv, ·]`` (K and V, or their codes and scales; pages are axis 1 of a leaf)."""
    return [
        (
            group.pool,
            [jax.ShapeDtypeStruct((leaf.shape[0], *leaf.shape[2:]), leaf.dtype) for leaf in jax.tree.leaves(group)],
        )
        for group in cache.groups
        if has(group, PagedStorage)
    ]


def _read_pages(cache: Cache, pages: dict[str, jax.Array]) -> list[list[jax.Array]]:
    """Pages ``pages[pool]`` ``[K]`` int32 of every paged group, page first: per group, each leaf's
    ``[K, L, ...]`` (padding reads the null page)."""
    return [
        [jnp.moveaxis(leaf[:, pages[group.pool]], 1, 0) for leaf in jax.tree.leaves(group)]
        for group in cache.groups
        if has(group, PagedStorage)
    ]


def _write_pages(cache: Cache, pages: dict[str, jax.Array], data: list[list[jax.Array]]) -> Cache:
    """The cache with pages ``pages[pool]`` ``[K]`` of every paged group set to ``data`` (as
    ``_read_pages`` returns it; padding writes the null page)."""
    found = iter(data)
    for index, group in enumerate(cache.groups):
        if not has(group, PagedStorage):
            continue
        leaves, treedef = jax.tree.flatten(group)
        written = [
            leaf.at[:, pages[group.pool]].set(jnp.moveaxis(new, 0, 1).astype(leaf.dtype))
            for leaf, new in zip(leaves, next(found), strict=True)
        ]
        cache = cache.with_group(index, jax.tree.unflatten(treedef, written))
    return cache


read_pages = jax.jit(_read_pages)
"""Device pages to copy to the host tier; one compile per padded page count (``ModelRunner.move_pages``)."""

write_pages = jax.jit(_write_pages, donate_argnums=0)
"""Host-tier pages written back into device pages (promotions, swap-ins); one compile per padded page count."""
