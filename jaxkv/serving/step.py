"""The compiled serving step: a packed batch of prefill chunks and decode tokens through the
model over paged K/V, then the tokens of each row that asked for them: one drawn token, or,
for a row that brought drafts, the drafts the target accepts and one token of its own.

Shapes are static per step shape: ``N`` packed tokens (``S`` decode slots of ``W`` tokens,
then a prefill bucket up to the token budget), ``S`` sample slots (one per scheduled chunk)
of ``W`` logits each, ``R`` rows (the engine's ``max_num_seqs``: block-table rows), ``W``
(static): 1, or ``1 + k`` in a step that verifies ``k`` drafts per row. The cache is donated
and updated in place; the step's metadata (``jaxkv.batch.PackedBatch``) travels beside it,
never in it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.batch import PackedBatch, PagedStorage
from jaxkv.cache import Cache
from jaxkv.decoding.sampling import RowSampling, row_logits, sample_rows
from jaxkv.protocol import has, pytree_class


@pytree_class
class StepInputs:
    """One step's packed batch and each row's draw.

    ``tokens`` ``[N]`` int32: the packed tokens; ``positions`` ``[N]`` int32: their absolute
    positions (-1: padding); ``packed``: each token's row and the block tables (``PackedBatch``);
    ``sample_index`` ``[S, W]`` int32: where each sample slot's chunk has its last token in the
    packed batch, then its drafts (repeated past them). ``drafts`` ``[S, W - 1]`` int32 and
    ``num_drafts`` ``[S]`` int32: each slot's draft tokens and how many are real.
    ``num_logprobs`` ``[S]`` int32: the top alternatives each slot asks for (none: no top-k is
    computed). ``seeds`` ``[S]`` uint32, ``sample_numbers``, ``counters`` ``[S]`` int32: a slot's
    j-th token is drawn with the key of (request seed, sequence index, tokens drawn so far + j),
    so a sequence's tokens do not depend on what it was batched with or on a preemption.
    ``sampling``: per-slot parameters ``[S]``.
    """

    tokens: jax.Array
    positions: jax.Array
    packed: PackedBatch
    sample_index: jax.Array
    drafts: jax.Array
    num_drafts: jax.Array
    num_logprobs: jax.Array
    seeds: jax.Array
    sample_numbers: jax.Array
    counters: jax.Array
    sampling: RowSampling


@pytree_class
class StepOutputs:
    """Per sample slot ``[S]``: ``num_accepted`` (int32) drafts kept, then its tokens ``[S, W]``
    (int32; the first ``num_accepted + 1`` are the row's new tokens) and their log-probabilities
    (float32), and the top ``M`` alternatives ``[S, W, M]`` (int32 ids, float32 log-probabilities)."""

    num_accepted: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    top_tokens: jax.Array
    top_logprobs: jax.Array


def _row_keys(inputs: StepInputs, width: int) -> jax.Array:
    """Keys ``[S, W]``: slot s's j-th token from (seed, sequence number, tokens drawn so far + j)."""

    def key(seed, sample_number, counter):
        base = jax.random.fold_in(jax.random.key(seed), sample_number)
        return jax.vmap(lambda j: jax.random.fold_in(base, counter + j))(jnp.arange(width))

    return jax.vmap(key)(inputs.seeds, inputs.sample_numbers, inputs.counters)


def _leading(flags: jax.Array) -> jax.Array:
    """``[S, K]`` bool -> ``[S]`` int32: how many of each row's first flags are all True."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=1), axis=1)


def verify_rows(
    logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, keys: jax.Array, params: RowSampling
) -> tuple[jax.Array, jax.Array]:
    """The drafts each row keeps and its tokens: ``logits`` ``[S, W, V]`` (position j scores the
    token after the row's token and its first j drafts), ``drafts`` ``[S, W - 1]`` (the first
    ``num_drafts`` ``[S]`` real), ``keys`` ``[S, W]``, ``params`` ``[S]``. Returns ``num_accepted``
    ``[S]`` (a) and ``tokens`` ``[S, W]``: the a kept drafts, then the target's own token.

    A greedy row keeps a draft that equals the target's argmax. A sampled row (drafts proposed
    deterministically: a one-hot q) keeps draft d with probability ``p(d)`` (``p``: the row's
    sampling distribution, ``row_logits``), and at the first rejection draws from ``p`` without
    d; after ``num_drafts`` acceptances it draws from ``p``. The draw at position j uses
    ``keys[:, j]`` exactly as ``sample_rows`` does (so a row without drafts draws the token a
    step without speculation draws), the acceptance test a key folded from it."""
    slots, width, vocab = logits.shape
    if width == 1:
        return jnp.zeros(slots, jnp.int32), sample_rows(logits[:, 0], keys[:, 0], params)[:, None]
    rows, checked = jnp.arange(slots), jnp.arange(width - 1)[None, :] < num_drafts[:, None]
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S, W]
    greedy_accepted = _leading((drafts == best[:, :-1]) & checked)

    def sampled():
        params_w = RowSampling(*(jnp.repeat(field, width) for field in params))
        scaled = row_logits(logits.reshape(slots * width, vocab), params_w).reshape(slots, width, vocab)
        p_draft = jnp.take_along_axis(jax.nn.softmax(scaled[:, :-1], axis=-1), drafts[..., None], axis=2)[..., 0]
        uniform = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1))))(keys[:, :-1])
        accepted = _leading((uniform < p_draft) & checked)
        rejected = drafts[rows, jnp.minimum(accepted, width - 2)]
        at = scaled[rows, accepted]  # [S, V]
        residual = jnp.where((accepted < num_drafts)[:, None] & (jnp.arange(vocab) == rejected[:, None]), -jnp.inf, at)
        residual = jnp.where(jnp.any(residual > -jnp.inf, axis=-1, keepdims=True), residual, at)
        own = jax.vmap(jax.random.categorical)(keys[rows, accepted], residual).astype(jnp.int32)
        return accepted, own

    sampling = params.temperature > 0
    greedy = (greedy_accepted, best[rows, greedy_accepted])
    accepted, own = jax.lax.cond(jnp.any(sampling), sampled, lambda: greedy)
    accepted = jnp.where(sampling, accepted, greedy_accepted)
    own = jnp.where(sampling, own, greedy[1])
    tokens = jnp.concatenate([drafts, drafts[:, :1]], axis=1).at[rows, accepted].set(own)
    return accepted, tokens


def serving_step(graphdef, state, cache: Cache, inputs: StepInputs, num_top: int) -> tuple[StepOutputs, Cache]:
    """Run the packed batch, then verify each sample slot's drafts and draw its tokens from the
    logits at its ``sample_index`` (slots that draw nothing this step are ignored by the host)."""
    model = nnx.merge(graphdef, state)
    slots, width = inputs.sample_index.shape
    logits, cache = model(
        inputs.tokens[None], inputs.positions[None], cache, logits_index=inputs.sample_index.reshape(1, -1),
        packed=inputs.packed,
    )  # fmt: skip
    logits = logits[0].reshape(slots, width, -1)  # [S, W, V]
    num_accepted, tokens = verify_rows(
        logits, inputs.drafts, inputs.num_drafts, _row_keys(inputs, width), inputs.sampling
    )
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]

    def top():
        top_logprobs, top_tokens = jax.lax.top_k(logprobs, num_top)
        return top_tokens.astype(jnp.int32), top_logprobs

    def none():  # no row asked for alternatives: skip the top-k over the vocabulary
        shape = (slots, width, num_top)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)

    top_tokens, top_logprobs = jax.lax.cond(jnp.any(inputs.num_logprobs > 0), top, none)
    return StepOutputs(num_accepted, tokens, chosen, top_tokens, top_logprobs), cache


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
