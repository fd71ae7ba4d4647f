"""Page retrieval attention (Quest, IceCache): every token kept, each query reads a budget of pages.

``RetrievalLayer`` stores every token as ``StaticLayer`` does (slot ``p`` holds position ``p``,
``[B, H_kv, S_max, D]``; in host memory under the container's ``offload``, IceCache's placement:
``PageRetrieval.host``) and keeps one summary per page of ``page_size`` tokens and K/V head
(``[B, H_kv, P, C, D]``, on the device):

* ``minmax`` (Quest): the element-wise minimum and maximum of the page's keys (C = 2). For a query
  q, ``sum_d max(q_d * min_d, q_d * max_d)`` bounds ``q . k`` of every key of the page from above.
* ``centroid`` (IceCache's cluster centres, here of sequential pages): the mean of the page's keys
  (C = 1), scored by ``q . mean``.

Each query (every query of an update, so that a prefill in chunks and token by token agree) and
K/V head reads ``budget`` tokens: the ``sink`` first pages, the ``recent`` pages up to and
including the query's own page, and the ``budget / page_size - sink - recent`` best scored of the
pages in between. Only those pages are candidates, and they are complete and before the query, so
a query's choice depends on its own key prefix only: the summaries of a page still filling are
never scored. A K/V head's score of a page is the largest over the query heads that read it (GQA).
A budget covering the whole context reads every page: exactly full attention.

Static shapes under jit: a top-k over the pages, then per query either a gather of the chosen pages
(``[B, H_kv, T, budget, D]``: a decode step reads ``budget`` tokens per head, not the context) or,
where that gather would hold more slots than the buffer (a long update), a mask of the chosen pages
over the buffer read block by block: both compute the same attention.

Rollback only shortens ``lengths`` (``Rollback``'s default): a page's summary is recomputed from
its stored keys (those below the row's length) whenever an update writes into it, and a page is
scored only once complete, so a rolled-back and refilled page is summarized again before it is
read. Rows are gathered leaf by leaf (``BatchMajorLayer``).

``ClusteredRetrievalLayer`` (``pages='clustered'``, IceCache's step): after an update of more than
a page per row (a prefill), each K/V head's complete pages are reordered so that a page holds
similar keys (k-means per K/V head), each token keeping its position; a decode page leaving the
recent pages is folded into the clusters (its tokens join their nearest centroids); no rollback.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Self

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.offload import fetch, host_rows, host_rows_set, moved, store
from jaxkv.protocol import (
    KV_AXES,
    DepthBudgets,
    HostMemory,
    KVView,
    MaskInfo,
    PositionalLayer,
    Refill,
    Rollback,
    check_capacity,
    check_update_inputs,
    describe_extent,
    entry,
    pytree_class,
)
from jaxkv.retrieval import RetrievalSpec, attended_pages, page_scores, page_summary
from jaxkv.sharding import BATCH, HEAD_DIM, KV_HEADS, KV_SLOTS, Axes
from jaxkv.softmax import attention_block_size, softmax_init, softmax_step

PAGES_PER_CLUSTER = 2  # clustered pages: k-means clusters of about this many pages' tokens
KMEANS_ITERATIONS = 10


def _whole_pages(max_length: int, page_size: int) -> int:
    return -(-max_length // page_size) * page_size


@pytree_class
class PageRetrieval(PositionalLayer, DepthBudgets, Refill, HostMemory):
    """What the retrieval layers share: every token's K/V, page summaries, the update and its view.
    Subclasses say which position each slot holds (``held_positions``) and may rearrange the slots
    after an update (``arranged``). An entry among the model's first ``spec.dense_layers`` layers
    (``dense``, set by ``for_layers`` when the container stacks the layers) reads every token: one
    stacked kind, so a model's scan over its layers stays one scan.

    ``host`` (``in_host_memory``, the container's ``offload``): ``keys`` and ``values`` live in host
    memory, everything else on the device. An update writes its tokens there and reads back only
    the keys of the pages it summarizes; a query reads only its pages, gathered in host memory
    (XLA's host compute) and copied over; what reads every token (a dense prefill, a dense layer, a
    long update's masked read, a clustered layer's reordering, a refill) copies the layer's entry
    to the device first."""

    keys: jax.Array  # [B, H_kv, S_max, D], S_max a multiple of page_size
    values: jax.Array  # [B, H_kv, S_max, D]
    summaries: jax.Array  # [B, H_kv, P, C, D]: per page, min and max (C = 2) or the mean (C = 1) of its keys
    lengths: jax.Array  # [B] int32
    dense: jax.Array  # [B] bool, equal in every row: this layer reads every token (``RetrievalSpec.dense_layers``)
    spec: RetrievalSpec = struct.field(pytree_node=False)
    host: bool = struct.field(pytree_node=False)  # keys and values in host memory (``in_host_memory``)

    MEMORY_FORMULA = "2·B·S_max·H_kv·D·bytes + C·B·(S_max/page)·H_kv·D·bytes + 5·B; C = 2 (minmax) or 1 (centroid)"

    @classmethod
    def create(cls, batch_size, num_kv_heads, head_dim, max_length: int, spec: RetrievalSpec, dtype=jnp.float32):
        """Room for ``max_length`` tokens, rounded up to whole pages."""
        if max_length <= 0:
            raise ValueError(f"RetrievalLayer: max_length must be positive, got {max_length}")
        slots = _whole_pages(max_length, spec.page_size)
        shape = (batch_size, num_kv_heads, slots, head_dim)
        pages = (batch_size, num_kv_heads, slots // spec.page_size, spec.summary_rows, head_dim)
        return cls(
            keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype), summaries=jnp.zeros(pages, dtype),
            lengths=jnp.zeros((batch_size,), jnp.int32), dense=jnp.zeros((batch_size,), bool), spec=spec,
            host=False, **cls.empty_order(batch_size, num_kv_heads, slots, head_dim, spec),
        )  # fmt: skip

    @staticmethod
    def empty_order(batch_size: int, num_kv_heads: int, slots: int, head_dim: int, spec: RetrievalSpec) -> dict:
        """The leaves recording which position each slot holds, empty (none: slot ``p`` holds ``p``)."""
        return {}

    @staticmethod
    def kv_bytes(batch_size, seq_len, num_kv_heads, head_dim, dtype, max_length=None, spec=None, **_) -> int:
        """Bytes of K/V for ``max_length`` (default ``seq_len``) tokens in whole pages, and their summaries."""
        slots = _whole_pages(max_length or seq_len, spec.page_size)
        per_token = num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
        summary = spec.summary_rows * (slots // spec.page_size) * per_token
        return batch_size * (2 * slots * per_token + summary + 5)

    def for_layers(self, layer_indices: list[int], num_layers: int) -> Self:
        """This stack (leaves ``[L, ...]``), entry j model layer ``layer_indices[j]`` of ``num_layers``:
        ``dense`` where that layer is among the first ``spec.dense_layers``."""
        if self.spec.dense_layers >= num_layers:
            raise ValueError(
                f"RetrievalSpec: dense_layers must be below the model's {num_layers} layers (some must retrieve), "
                f"got {self.spec.dense_layers}"
            )
        dense = jnp.asarray([i < self.spec.dense_layers for i in layer_indices])[:, None]
        return self.replace(dense=jnp.broadcast_to(dense, self.dense.shape))

    @property
    def max_length(self) -> int:
        return self.capacity

    def describe(self) -> str:
        spec = self.spec
        return describe_extent(0, budget=spec.budget, page=spec.page_size) + f" {spec.summary}"

    def held_positions(self, index) -> jax.Array:
        """``[B, H_kv, S]``: the position each slot of entry ``index`` holds (written or not)."""
        batch, heads = self.keys.shape[1:3]
        return jnp.broadcast_to(jnp.arange(self.capacity, dtype=jnp.int32), (batch, heads, self.capacity))

    def kv_positions(self, index) -> jax.Array:
        """``[B, H_kv, S]``: ``held_positions``, -1 at or past each row's length."""
        held = self.held_positions(index)
        return jnp.where(held < entry(self.lengths, index)[:, None, None], held, -1)

    def held_entry(self, index):
        """Entry ``index``'s tokens in position order (``HeldTokens``; the same order in every head)."""
        if self.host:
            return fetch(self, index, self.host_leaves()).replace(host=False).held_entry(0)
        positions = self.kv_positions(index)
        order = jnp.argsort(jnp.where(positions < 0, jnp.iinfo(jnp.int32).max, positions), axis=-1)
        take = lambda x: jnp.take_along_axis(entry(x, index), order[..., None], axis=2)
        return take(self.keys), take(self.values), jnp.take_along_axis(positions, order, axis=-1)[:, 0]

    # --- host memory (``HostMemory``) ------------------------------------------------------------
    def in_host_memory(self) -> Self:
        layer = self.replace(host=True)
        return moved(layer, layer.host_leaves(), jax.memory.Space.Host)

    def host_leaves(self) -> Self:
        """``keys`` and ``values``: the summaries and the slot bookkeeping stay on the device, where
        every query reads them."""
        return jax.tree.map(lambda _: False, self).replace(keys=True, values=True)

    def stored(self, index, keys, values, slots) -> Self:
        """``PositionalLayer.stored``; in host memory, a scatter there of the new tokens alone."""
        if not self.host:
            return super().stored(index, keys, values, slots)
        batch, heads = keys.shape[:2]
        coords = _coords(index, jnp.arange(batch)[:, None, None], jnp.arange(heads)[None, :, None], slots[:, None])
        coords = coords.reshape(-1, 4)  # [B * H_kv * T, 4]; a slot past the buffer is dropped
        put = lambda stack, new: host_rows_set(stack, coords, new.reshape(coords.shape[0], new.shape[-1]))
        return self.replace(keys=put(self.keys, keys), values=put(self.values, values))

    def through_device(self, index, fn: Callable[[Self], Self]) -> Self:
        """``fn`` (a one-entry stack on the device -> the same) applied to entry ``index`` of a
        host-memory layer: the entry copied to the device, and back after."""
        mask = self.host_leaves()
        return store(self, index, fn(fetch(self, index, mask).replace(host=False)).replace(host=True), mask)

    def filled_from(self, source, layer_indices: list[int], num_layers: int) -> Self:
        """``Refill.filled_from``; in host memory, filled on the device, then moved there."""
        if not self.host:
            return super().filled_from(source, layer_indices, num_layers)
        device = moved(self, self.host_leaves(), jax.memory.Space.Device).replace(host=False)
        return device.filled_from(source, layer_indices, num_layers).in_host_memory()

    def arranged(self, index, num_new: int) -> Self:
        """Entry ``index`` after an update of ``num_new`` tokens per row, its slots rearranged (here:
        as written). A short update's (at most ``page_size`` tokens per row: a decode step) is
        rearranged before its queries read (``update_entry``), so the step reads and carries one
        buffer (reading the slots as written and carrying the rearranged ones would make XLA copy
        the whole stack at every step); a longer update's queries read the slots as written."""
        return self

    def logical_axes(self):
        return self.replace(
            keys=KV_AXES, values=KV_AXES, summaries=Axes(BATCH, KV_HEADS, None, None, HEAD_DIM), lengths=Axes(BATCH),
            dense=Axes(BATCH),
        )  # fmt: skip

    def update_entry(self, index, keys, values, positions):
        """Store ``[B, H_kv, T, D]`` at ``positions`` ``[B, T]`` and summarize the pages written;
        returns the layer and a ``RetrievalView`` of every stored token."""
        positions = check_update_inputs(self, index, keys, values, positions)
        check_capacity(self, positions, self.capacity)
        old_lengths = entry(self.lengths, index)
        new, view = self.write(index, keys, values, positions)
        num_new = positions.shape[1]
        new = new.summarized(index, old_lengths, num_new)
        short = num_new <= self.spec.page_size
        if short:
            new = new.arranged(index, num_new)
        mask_info = MaskInfo(new.kv_positions(index), slots_used=view.mask_info.slots_used)
        summaries = entry(new.summaries, index)
        dense = entry(self.dense, index)[0]
        view = RetrievalView(new.keys, new.values, index, mask_info, summaries, dense, self.spec, self.host)
        return (new if short else new.arranged(index, num_new)), view

    def summarized(self, index, old_lengths: jax.Array, num_new: int) -> Self:
        """Entry ``index`` with the summaries of the pages an update of ``num_new`` tokens per row
        wrote (from each row's ``old_lengths`` ``[B]`` on) computed again from their stored keys."""
        page, num_pages = self.spec.page_size, self.summaries.shape[-3]
        count = min(num_pages, (num_new - 1) // page + 2)  # pages a run of num_new tokens can touch
        lengths = entry(self.lengths, index)
        pages = old_lengths[:, None] // page + jnp.arange(count, dtype=jnp.int32)  # [B, n]
        slots = pages[:, :, None] * page + jnp.arange(page, dtype=jnp.int32)  # [B, n, page]
        rows = jnp.arange(lengths.shape[0])[:, None, None]
        page_keys = self.slot_keys(index, jnp.minimum(slots, self.capacity - 1))  # [B, n, page, H_kv, D]
        filled = (slots < lengths[:, None, None])[..., None, None]
        summary = page_summary(self.spec.summary, page_keys.astype(jnp.float32), filled)  # [B, n, H_kv, C, D]
        written = jnp.where(pages * page < lengths[:, None], pages, num_pages)  # a page with no token: dropped
        stored = self.summaries.at[index, rows[:, :, 0], :, written].set(
            summary.astype(self.summaries.dtype), mode="drop"
        )
        return self.replace(summaries=stored)

    def slot_keys(self, index, slots: jax.Array) -> jax.Array:
        """The keys ``[B, n, page, H_kv, D]`` at ``slots`` ``[B, n, page]`` (in range) of entry
        ``index``; in host memory, only those cross to the device."""
        rows = jnp.arange(slots.shape[0])[:, None, None]
        if not self.host:
            return self.keys[index, rows, :, slots]
        heads = jnp.arange(self.keys.shape[2])
        return host_rows(self.keys, _coords(index, rows[..., None], heads, slots[..., None]))


def _coords(index, rows: jax.Array, heads: jax.Array, slots: jax.Array) -> jax.Array:
    """``[..., 4]`` int32: the coordinates ``(index, row, head, slot)`` in a stack ``[L, B, H_kv, S, D]``
    of ``slots`` of ``rows`` and ``heads`` (broadcast together)."""
    parts = jnp.broadcast_arrays(jnp.asarray(index, jnp.int32), rows, heads, slots)
    return jnp.stack([part.astype(jnp.int32) for part in parts], axis=-1)


@pytree_class
class RetrievalLayer(PageRetrieval, Rollback):
    """Every token's K/V ``[B, H_kv, S_max, D]`` and page summaries; each query reads a budget of pages."""


@pytree_class
class ClusteredRetrievalLayer(PageRetrieval):
    """``RetrievalLayer`` whose prefill pages hold similar keys: ``[B, H_kv, S_max, D]`` reordered per K/V head.

    After an update of more than ``page_size`` tokens per row (a prefill, or a chunk of one), each
    K/V head's complete pages between the sink pages and the ``recent - 1`` pages before the next
    query's are reordered (IceCache's step): their keys are clustered by k-means (``KMEANS_ITERATIONS``,
    about ``PAGES_PER_CLUSTER`` pages of tokens per cluster, per K/V head) and laid out cluster by
    cluster, so that a page holds similar keys; ``slot_positions`` records the position each slot
    holds (masks and RoPE stay those of the tokens' positions). Shorter updates (decode steps) write
    the later pages in order; once a page leaves the recent pages, its tokens are folded into the
    clusters (each joins its nearest k-means centroid, the centroids kept as fitted) and the slots
    up to it are laid out cluster by cluster again (``folded``: under ``lax.cond``, so a step that
    fills no page pays nothing). The next long update clusters every page again. No rollback:
    re-fed tokens would land on reordered slots.
    """

    slot_positions: jax.Array  # [B, H_kv, S_max] int32: the position held by each slot below ``clustered``
    slot_clusters: jax.Array  # [B, H_kv, S_max] int32: the cluster of each slot's token below ``clustered``
    centroids: jax.Array  # [B, H_kv, K, D] float32: the k-means centroids, K = S_max / page / PAGES_PER_CLUSTER
    clustered: jax.Array  # [B] int32: slots below hold the reordered pages (and the sink pages, in order)

    MEMORY_FORMULA = (
        "2·B·S_max·H_kv·D·bytes + C·B·(S_max/page)·H_kv·D·bytes + 8·B·S_max·H_kv + 4·B·K·H_kv·D + 9·B; "
        "C = 2 (minmax) or 1 (centroid), K = max(1, S_max / page / 2) centroids"
    )
    WHY_NOT = {
        Rollback: "its prefill's pages were reordered by clustering, and tokens fed again would land on their "
        "slots; roll back (or decode speculatively) with pages='sequential'"
    }

    @staticmethod
    def empty_order(batch_size: int, num_kv_heads: int, slots: int, head_dim: int, spec: RetrievalSpec) -> dict:
        return {
            "slot_positions": jnp.zeros((batch_size, num_kv_heads, slots), jnp.int32),
            "slot_clusters": jnp.zeros((batch_size, num_kv_heads, slots), jnp.int32),
            "centroids": jnp.zeros((batch_size, num_kv_heads, _cluster_count(slots, spec), head_dim), jnp.float32),
            "clustered": jnp.zeros((batch_size,), jnp.int32),
        }

    @staticmethod
    def kv_bytes(batch_size, seq_len, num_kv_heads, head_dim, dtype, max_length=None, spec=None, **_) -> int:
        """``RetrievalLayer.kv_bytes``, the slot positions and clusters, and the centroids."""
        slots = _whole_pages(max_length or seq_len, spec.page_size)
        order = 4 * batch_size * (2 * num_kv_heads * slots + num_kv_heads * _cluster_count(slots, spec) * head_dim + 1)
        return RetrievalLayer.kv_bytes(batch_size, seq_len, num_kv_heads, head_dim, dtype, max_length, spec) + order

    def describe(self) -> str:
        return super().describe() + " clustered"

    def logical_axes(self):
        slots = Axes(BATCH, KV_HEADS, KV_SLOTS)
        return super().logical_axes().replace(
            slot_positions=slots, slot_clusters=slots, centroids=Axes(BATCH, KV_HEADS, None, HEAD_DIM),
            clustered=Axes(BATCH),
        )  # fmt: skip

    def held_positions(self, index) -> jax.Array:
        slot = super().held_positions(index)
        reordered = slot < entry(self.clustered, index)[:, None, None]
        return jnp.where(reordered, entry(self.slot_positions, index), slot)

    def arranged(self, index, num_new: int) -> ClusteredRetrievalLayer:
        """Entry ``index`` after an update of ``num_new`` tokens per row: more than ``page_size``, its
        pages clustered afresh; fewer, the page that left the recent pages (if one did) folded in."""
        if self.host:
            return self._arranged_on_device(index, num_new)
        if num_new <= self.spec.page_size:
            return self.folded(index)
        lengths = entry(self.lengths, index)
        cut, start = self.cut(lengths), self.spec.sink * self.spec.page_size
        member = (jnp.arange(self.capacity) >= start) & (jnp.arange(self.capacity) < cut[:, None])  # [B, S]
        keys = entry(self.keys, index).astype(jnp.float32)
        labels, centroids = _kmeans(keys, member, start, cut, self.centroids.shape[-2])
        layer = self.replace(centroids=self.centroids.at[index].set(centroids))
        return layer.laid_out(index, labels, cut, jnp.ones_like(lengths, bool))

    def _arranged_on_device(self, index, num_new: int) -> ClusteredRetrievalLayer:
        """``arranged`` of a host-memory layer: its entry through the device (``through_device``),
        after a short update only when a page left the recent pages (``folded``'s condition)."""
        rearrange = lambda layer: layer.through_device(index, lambda window: window.arranged(0, num_new))
        if num_new > self.spec.page_size:
            return rearrange(self)
        return jax.lax.cond(jnp.any(self._fold_pending(index)), rearrange, lambda layer: layer, self)

    def _fold_pending(self, index) -> jax.Array:
        """``[B]`` bool: rows of entry ``index`` with a page out of the recent pages not yet folded in."""
        return self.cut(entry(self.lengths, index)) > entry(self.clustered, index)

    def folded(self, index) -> ClusteredRetrievalLayer:
        """Entry ``index`` with the page that left the recent pages in a short update (at most one
        per row: the update wrote at most ``page_size`` tokens) folded into the clusters: each of its
        tokens joins its nearest centroid and the slots up to it are laid out again (rows whose
        recent pages did not move are left as they are; no row moved: nothing is computed)."""
        page, start = self.spec.page_size, self.spec.sink * self.spec.page_size
        clustered = entry(self.clustered, index)
        cut = self.cut(entry(self.lengths, index))
        moved = self._fold_pending(index)  # [B]

        def fold(layer: ClusteredRetrievalLayer) -> ClusteredRetrievalLayer:
            slots = jnp.maximum(clustered, start)[:, None] + jnp.arange(page)  # [B, page]: the page that left
            keys = jnp.take_along_axis(
                entry(layer.keys, index), jnp.minimum(slots, layer.capacity - 1)[:, None, :, None], axis=2
            )  # [B, H_kv, page, D]
            labels = _nearest(keys.astype(jnp.float32), entry(layer.centroids, index))  # [B, H_kv, page]
            rows, heads = jnp.arange(slots.shape[0])[:, None, None], jnp.arange(keys.shape[1])[None, :, None]
            written = jnp.where(slots < cut[:, None], slots, layer.capacity)[:, None, :]  # [B, 1, page]
            clusters = entry(layer.slot_clusters, index).at[rows, heads, written].set(labels, mode="drop")
            return layer.laid_out(index, clusters, cut, moved)

        return jax.lax.cond(jnp.any(moved), fold, lambda layer: layer, self)

    def cut(self, lengths: jax.Array) -> jax.Array:
        """``[B]``: the slots ``[sink pages, cut)`` that are clustered at ``lengths`` ``[B]``: the complete
        pages before the ``recent - 1`` pages preceding the next query's own."""
        page, start = self.spec.page_size, self.spec.sink * self.spec.page_size
        return jnp.maximum(start, (lengths // page - self.spec.recent + 1) * page)

    def laid_out(self, index, labels: jax.Array, cut: jax.Array, rows: jax.Array) -> ClusteredRetrievalLayer:
        """Entry ``index`` with each row of ``rows`` ``[B]`` (bool) laid out by the clusters ``labels``
        ``[B, H_kv, S]`` of its slots ``[sink pages, cut)`` (``cut`` ``[B]``): the sink slots first,
        then those slots cluster by cluster (in position order within one), then the rest; the slot
        positions and clusters travel with the tokens and every page is summarized again."""
        num_slots, count = self.capacity, self.centroids.shape[-2]
        slot = jnp.arange(num_slots, dtype=jnp.int32)
        start = self.spec.sink * self.spec.page_size
        member = (slot >= start) & (slot < cut[:, None])  # [B, S]
        group = jnp.where(member[:, None], labels + 1, jnp.where(slot < start, 0, count + 1))
        held = self.held_positions(index)
        order = jnp.where(rows[:, None, None], jnp.argsort(group * num_slots + held, axis=-1), slot)  # [B, H_kv, S]
        take = lambda x: jnp.take_along_axis(x, order[..., None], axis=2)
        layer = self.replace(
            keys=self.keys.at[index].set(take(entry(self.keys, index))),
            values=self.values.at[index].set(take(entry(self.values, index))),
            slot_positions=self.slot_positions.at[index].set(jnp.take_along_axis(held, order, axis=-1)),
            slot_clusters=self.slot_clusters.at[index].set(jnp.take_along_axis(labels, order, axis=-1)),
            clustered=self.clustered.at[index].set(jnp.where(rows, cut, entry(self.clustered, index))),
        )
        return layer.summarized(index, jnp.zeros_like(cut), num_slots)


# pages= -> the layer class (``RetrievalSpec.pages``).
RETRIEVAL_LAYERS = {"sequential": RetrievalLayer, "clustered": ClusteredRetrievalLayer}


def _cluster_count(slots: int, spec: RetrievalSpec) -> int:
    """K: the k-means clusters of a clustered layer of ``slots`` slots (about ``PAGES_PER_CLUSTER`` pages each)."""
    return max(1, slots // spec.page_size // PAGES_PER_CLUSTER)


def _nearest(keys: jax.Array, centroids: jax.Array) -> jax.Array:
    """The nearest of ``centroids`` ``[B, H_kv, K, D]`` to each key ``[B, H_kv, S, D]`` (float32): ``[B, H_kv, S]``."""
    distance = jnp.sum(centroids**2, -1)[:, :, None, :] - 2 * jnp.einsum("bhsd,bhkd->bhsk", keys, centroids)
    return jnp.argmin(distance, axis=-1).astype(jnp.int32)


def _kmeans(keys: jax.Array, member: jax.Array, start: int, cut: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """The cluster ``[B, H_kv, S]`` of each key ``[B, H_kv, S, D]`` (float32) among ``count`` k-means
    centroids ``[B, H_kv, count, D]`` (returned too) fitted per row and K/V head to the ``member``
    slots ``[B, S]`` (``[start, cut)``, ``cut`` ``[B]``), seeded with evenly spaced members."""
    num_slots = keys.shape[2]
    seeds = start + (jnp.arange(count) * (cut - start)[:, None]) // count  # [B, count]
    centroids = jnp.take_along_axis(keys, jnp.minimum(seeds, num_slots - 1)[:, None, :, None], axis=2)
    weights = member[:, None, :, None].astype(jnp.float32)  # [B, 1, S, 1]

    def step(_, centroids: jax.Array) -> jax.Array:
        assigned = (_nearest(keys, centroids)[..., None] == jnp.arange(count)) * weights  # [B, H_kv, S, count]
        totals = jnp.sum(assigned, axis=2)[..., None]  # [B, H_kv, count, 1]
        sums = jnp.einsum("bhsk,bhsd->bhkd", assigned, keys)
        return jnp.where(totals > 0, sums / jnp.maximum(totals, 1.0), centroids)

    centroids = jax.lax.fori_loop(0, KMEANS_ITERATIONS, step, centroids)
    return _nearest(keys, centroids), centroids


@pytree_class
class RetrievalView(KVView):
    """A retrieval layer's update: ``keys``/``values``/``mask_info`` hold every stored token (what a
    budget covering the context reads; ``kv_positions`` ``[B, H_kv, S]``, per head as clustered pages
    differ); ``attend`` reads each query's pages (``attended_pages``)."""

    summaries: jax.Array  # [B, H_kv, P, C, D]
    dense: jax.Array  # [] bool: every query reads every token (a layer among ``spec.dense_layers``)
    spec: RetrievalSpec = struct.field(pytree_node=False)
    host: bool = struct.field(pytree_node=False, default=False)  # the stacks in host memory (``PageRetrieval.host``)

    def on_device(self) -> RetrievalView:
        """This view with its entry on the device (itself when it is there): what a read of every
        token takes."""
        if not self.host:
            return self
        keys, values = fetch((self.key_stack, self.value_stack), self.index, (True, True))
        return self.replace(key_stack=keys, value_stack=values, index=0, host=False)

    def pages(self, queries: jax.Array, q_positions: jax.Array) -> jax.Array:
        """The pages ``[B, H_kv, T, A]`` (-1: none) that ``queries`` ``[B, H_q, T, D]`` at ``q_positions``
        ``[B, T]`` read."""
        grouped = _grouped(queries, self.shape[1])
        return attended_pages(self.spec, page_scores(self.spec.summary, grouped, self.summaries), q_positions)

    def attend(self, queries, q_positions, *, scale: float, logit_softcap=None, block_size=None, query_weights=None):
        """Softmax attention of ``queries`` ``[B, H_q, T, D]`` over each query's pages: a gather of them
        where it holds fewer slots than the buffer, else a mask of them over the buffer read in blocks
        of ``block_size`` slots (default ``attention_block_size``); over every token for a dense
        prefill (``RetrievalSpec.prefill``) and in a dense layer (``RetrievalSpec.dense_layers``).
        Returns ``[B, H_q, T, D]``."""
        if query_weights is not None:
            raise ValueError(
                "a retrieval layer reads a budget of pages per query and reports no slot mass; query_weights "
                "serve an evicting layer's scores"
            )
        options = {"q_positions": q_positions, "scale": scale, "logit_softcap": logit_softcap, "block_size": block_size}
        dense = lambda queries: KVView.attend(self.on_device(), queries, **options)
        if self.spec.prefill == "dense" and queries.shape[2] > self.spec.page_size:
            return dense(queries)
        if self.spec.dense_layers == 0:
            return self.retrieved(queries, **options)
        return jax.lax.cond(self.dense, dense, functools.partial(self.retrieved, **options), queries)

    def retrieved(self, queries, q_positions, *, scale: float, logit_softcap, block_size) -> jax.Array:
        """``attend``'s read of each query's pages: ``[B, H_q, T, D]`` of ``queries`` ``[B, H_q, T, D]``."""
        batch, num_heads, length, head_dim = queries.shape
        pages = self.pages(queries, q_positions)
        read = _Read(_grouped(queries, self.shape[1]), q_positions, scale, logit_softcap)
        if length * pages.shape[-1] * self.spec.page_size < self.shape[2]:
            out, total = read.gathered(self, pages)
        else:
            out, total = read.masked(self.on_device(), pages, block_size or attention_block_size(self.shape[2]))
        out = out / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
        return out.reshape(batch, num_heads, length, head_dim).astype(queries.dtype)


def _grouped(queries: jax.Array, num_kv_heads: int) -> jax.Array:
    """``[B, H_q, T, D]`` -> ``[B, H_kv, G, T, D]`` (query head h reads K/V head ``h // G``)."""
    batch, num_heads, length, head_dim = queries.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"attention: {num_heads} query heads is not a multiple of {num_kv_heads} K/V heads")
    return queries.reshape(batch, num_kv_heads, num_heads // num_kv_heads, length, head_dim)


@dataclasses.dataclass(frozen=True)
class _Read:
    """One attention call over a ``RetrievalView``: queries ``[B, H_kv, G, T, D]`` at ``positions`` ``[B, T]``."""

    grouped: jax.Array
    positions: jax.Array
    scale: float
    logit_softcap: float | None

    def logits(self, raw: jax.Array, kv_positions: jax.Array) -> jax.Array:
        """``raw`` ``q . k`` ``[B, H_kv, G, T, S]`` scaled, capped and masked (-inf) by the causal rule
        over ``kv_positions`` ``[B, H_kv, T, S]`` (-1: not read)."""
        logits = raw * self.scale
        if self.logit_softcap is not None:
            logits = self.logit_softcap * jnp.tanh(logits / self.logit_softcap)
        q = self.positions[:, None, :, None]
        visible = (kv_positions >= 0) & (q >= 0) & (kv_positions <= q)
        return jnp.where(visible[:, :, None], logits, -jnp.inf)

    def softmax(self, raw: jax.Array, kv_positions: jax.Array, weigh, carry=None):
        """``carry`` (default: empty) folded with one block of ``raw`` logits (see ``logits``) and
        ``weigh(weights)``, its weighted values (``jaxkv.softmax.softmax_step``)."""
        carry = softmax_init(self.grouped.shape[:-1], self.grouped.shape[-1]) if carry is None else carry
        return softmax_step(carry, self.logits(raw, kv_positions), weigh)

    def gathered(self, view: RetrievalView, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Weighted values and totals (``[B, H_kv, G, T, D]``, ``[..., 1]``) over the gathered ``pages``
        ``[B, H_kv, T, A]``: ``A * page_size`` slots per query."""
        page = view.spec.page_size
        batch, heads, length, count = pages.shape
        rows = jnp.arange(batch)[:, None, None, None]
        head = jnp.arange(heads)[None, :, None, None]
        safe = jnp.maximum(pages, 0)

        slots = safe[..., None] * page + jnp.arange(page, dtype=jnp.int32)  # [B, H_kv, T, A, page]

        def gather(stack: jax.Array) -> jax.Array:  # [L, B, H_kv, S, D] -> [B, H_kv, T, A * page, D]
            if view.host:  # the chosen pages alone cross to the device
                found = host_rows(stack, _coords(view.index, rows[..., None], head[..., None], slots))
                return found.reshape(batch, heads, length, count * page, -1)
            paged = stack.reshape(*stack.shape[:3], stack.shape[3] // page, page, stack.shape[4])
            return paged[view.index, rows, head, safe].reshape(batch, heads, length, count * page, -1)

        keys, values = gather(view.key_stack), gather(view.value_stack)
        held = view.mask_info.kv_positions[rows[..., None], head[..., None], slots]  # -1 past the row's length
        kv_positions = jnp.where(pages[..., None] >= 0, held, -1).reshape(batch, heads, length, count * page)
        raw = jnp.einsum("bhgtd,bhtsd->bhgts", self.grouped, keys, preferred_element_type=jnp.float32)

        def weigh(weights: jax.Array) -> jax.Array:
            return jnp.einsum(
                "bhgts,bhtsd->bhgtd", weights.astype(values.dtype), values, preferred_element_type=jnp.float32
            )

        _, total, out = self.softmax(raw, kv_positions, weigh)
        return out, total

    def masked(self, view: RetrievalView, pages: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
        """Weighted values and totals over the whole buffer, each query's slots outside its ``pages``
        ``[B, H_kv, T, A]`` masked, read in blocks of ``block_size`` slots up to the filled ones."""
        page, num_slots = view.spec.page_size, view.shape[2]
        chosen = jnp.any(pages[..., None] == jnp.arange(num_slots // page), axis=-2)  # [B, H_kv, T, P]
        block = block_size if num_slots % block_size == 0 and block_size % page == 0 else num_slots

        def step(number, carry):
            start = number * block
            keys, values = view.read(start, block)
            held = jax.lax.dynamic_slice_in_dim(view.mask_info.kv_positions, start, block, axis=-1)  # [B, H_kv, block]
            read = jax.lax.dynamic_slice_in_dim(chosen, start // page, block // page, axis=-1)
            kv_positions = jnp.where(jnp.repeat(read, page, axis=-1), held[:, :, None, :], -1)
            raw = jnp.einsum("bhgtd,bhsd->bhgts", self.grouped, keys, preferred_element_type=jnp.float32)

            def weigh(weights: jax.Array) -> jax.Array:
                return jnp.einsum(
                    "bhgts,bhsd->bhgtd", weights.astype(values.dtype), values, preferred_element_type=jnp.float32
                )

            return self.softmax(raw, kv_positions, weigh, carry)

        used = num_slots if view.mask_info.slots_used is None else view.mask_info.slots_used
        init = softmax_init(self.grouped.shape[:-1], self.grouped.shape[-1])
        _, total, out = jax.lax.fori_loop(0, (used + block - 1) // block, step, init)
        return out, total
