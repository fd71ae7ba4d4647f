"""Decode attention over MLA's latent cache and DSA against a full-head cache (issue 43, deliverable 6).

    jaxkv bench latent                                      # S = 256, 1k, 4k, 16k, top-256
    python scripts/bench_latent.py --contexts 256 1024 4096 16384 --iters 20
    jaxkv bench latent --contexts 16 32 --index-topk 8 --iters 2 --rank 16 --heads 2     # a smoke run

One layer holds ``batch`` rows of ``S`` random tokens; each row decodes one token at position
``S``. Every case is a jitted step (the cache donated, so the write is in place) timed as the
median of ``--iters`` calls after a compiling one:

* ``full-head``: ``full_attention`` (``StaticLayer``) of ``H`` K/V heads of ``n + P`` (= ``v``):
  the cache MLA replaces, read by ``jaxkv.attention.cached_attention``.
* ``latent``: ``latent_attention`` (``LatentLayer``): entries ``[R + P]`` a token, read densely in
  the absorbed form (``jaxkv.mla``).
* ``dsa``: ``indexed_attention`` (``IndexedLayer``): the write, the lightning indexer's scores over
  all ``S`` keys, the top ``index_topk`` and the absorbed attention over the gathered entries.
* ``dsa-attention``: the attention part of DSA alone (``SelectedView.attend_latent`` over ``K``
  fixed slots): what the issue asks to be flat in ``S`` once ``S`` exceeds ``index_topk``.
* ``dsa-indexer``: the indexer part alone (``select_slots``: scores and top-k), linear in ``S``.

Bytes read per step and row (computed, the cache's own reads; weights apart): full-head
``S·2·H·(n+P)``, latent ``S·(R+P)``, DSA ``S·D_I`` (indexer keys) ``+ K·(R+P)`` (the gather),
times the dtype's bytes. The timings are one shared CPU's unless the machine was quiet.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxkv.attention import cached_attention
from jaxkv.cache import Cache
from jaxkv.layers.indexed import IndexedQueries, IndexerQueries, SelectedView, select_slots
from jaxkv.mla import LatentQueries, LatentSpec, LatentWeights
from jaxkv.protocol import MaskInfo

CASES = ("full-head", "latent", "dsa", "dsa-attention", "dsa-indexer")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384], help="S per case")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16, help="H: query heads (and the full-head cache's K/V heads)")
    parser.add_argument("--rank", type=int, default=128, help="R: kv_lora_rank")
    parser.add_argument("--rope-dim", type=int, default=32, help="P: qk_rope_head_dim")
    parser.add_argument("--nope-dim", type=int, default=32, help="n: qk_nope_head_dim (v = n + P)")
    parser.add_argument("--index-dim", type=int, default=64, help="D_I: index_head_dim")
    parser.add_argument("--index-heads", type=int, default=4, help="H_I: index_n_heads")
    parser.add_argument("--index-topk", type=int, default=256, help="K: index_topk")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per case (the median is reported)")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = parser.parse_args(argv)
    for name in ("batch", "heads", "rank", "rope_dim", "nope_dim", "index_dim", "index_heads", "index_topk", "iters"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if min(args.contexts) <= 0:
        parser.error(f"--contexts must be positive, got {args.contexts}")
    return args


def step_bytes(case: str, context: int, args) -> int:
    """Cache bytes one decode step reads per row (module docstring)."""
    width, size = args.rank + args.rope_dim, jnp.dtype(args.dtype).itemsize
    values = {
        "full-head": context * 2 * args.heads * (args.nope_dim + args.rope_dim),
        "latent": context * width,
        "dsa": context * args.index_dim + min(args.index_topk, context) * width,
        "dsa-attention": min(args.index_topk, context) * width,
        "dsa-indexer": context * args.index_dim,
    }
    return values[case] * size


def _normal(key: int, shape, dtype) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape, dtype)


def _timed(step, state, *inputs, iters: int) -> float:
    """Median seconds of ``state = step(state, *inputs)[0]`` over ``iters`` calls after a compiling one."""
    state, out = step(state, *inputs)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        state, out = step(state, *inputs)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Layer:
    """One layer's random inputs at context ``S``: the filled caches, the new token and its queries."""

    def __init__(self, context: int, args):
        b, h, dtype = args.batch, args.heads, jnp.dtype(args.dtype)
        self.args, self.context, self.dtype = args, context, dtype
        self.spec = LatentSpec(args.rank, args.rope_dim, args.index_dim, args.index_topk)
        self.weights = LatentWeights(
            _normal(1, (h, 2 * args.nope_dim + args.rope_dim, args.rank), dtype), args.nope_dim
        )
        self.queries = LatentQueries(
            _normal(2, (b, h, 1, args.nope_dim), dtype), _normal(3, (b, h, 1, args.rope_dim), dtype)
        )
        self.indexer = IndexerQueries(
            _normal(4, (b, 1, args.index_heads, args.index_dim), dtype), _normal(5, (b, 1, args.index_heads), dtype)
        )
        self.entries = _normal(6, (b, 1, context, self.spec.width), dtype)
        self.index_keys = _normal(7, (b, 1, context, args.index_dim), dtype)
        self.scale = (args.nope_dim + args.rope_dim) ** -0.5

    def cache(self, kind: str, **options) -> Cache:
        return Cache.from_layer_types(
            [kind], batch_size=self.args.batch, num_kv_heads=options.pop("heads", 1), max_length=self.context + 1,
            dtype=self.dtype, **options,
        )  # fmt: skip

    def seconds(self, case: str) -> float:
        """Median seconds of one step of ``case`` (one of ``CASES``)."""
        steps = {"full-head": self._full_head, "latent": self._latent, "dsa": self._dsa,
                 "dsa-attention": self._dsa_attention, "dsa-indexer": self._dsa_indexer}  # fmt: skip
        return steps[case]()

    def _full_head(self) -> float:
        a, d = self.args, self.args.nope_dim + self.args.rope_dim
        cache = self.cache("full_attention", heads=a.heads, head_dim=d)
        kv = _normal(8, (a.batch, a.heads, self.context, d), self.dtype)
        cache, _ = cache.update(0, kv, kv, cache.next_positions(self.context))
        query = _normal(9, (a.batch, a.heads, 1, d), self.dtype)
        new = _normal(10, (a.batch, a.heads, 1, d), self.dtype)
        positions = cache.next_positions(1)

        @functools.partial(jax.jit, donate_argnums=0)
        def step(cache, positions):
            return cached_attention(cache, 0, query, new, new, positions, scale=self.scale)

        return _timed(step, cache, positions, iters=a.iters)

    def _read(self, latent_queries, view, q_positions, _):
        return view.attend_latent(latent_queries, q_positions, self.weights, self.scale), None

    def _attend_step(self, kind: str, queries, index_keys) -> float:
        cache = self.cache(kind, head_dim=self.spec.width, latent=self.spec)
        cache, _ = cache.update(0, self.entries, index_keys, cache.next_positions(self.context))
        new = self.entries[:, :, :1]
        new_index = None if index_keys is None else index_keys[:, :, :1]
        positions = cache.next_positions(1)

        @functools.partial(jax.jit, donate_argnums=0)
        def step(cache, positions):
            return cache.attend(0, queries, new, new_index, positions, self._read)

        return _timed(step, cache, positions, iters=self.args.iters)

    def _latent(self) -> float:
        return self._attend_step("latent_attention", self.queries, None)

    def _dsa(self) -> float:
        return self._attend_step("indexed_attention", IndexedQueries(self.queries, self.indexer), self.index_keys)

    def _selection(self):
        """``(positions [B, 1], mask_info, slots, chosen)`` of the decode query at position ``S - 1``."""
        kv_positions = jnp.broadcast_to(jnp.arange(self.context, dtype=jnp.int32), (self.args.batch, self.context))
        mask_info = MaskInfo(kv_positions, slots_used=jnp.int32(self.context))
        q_positions = jnp.full((self.args.batch, 1), self.context - 1, jnp.int32)
        slots, chosen = select_slots(self.indexer, self.index_keys[:, 0], q_positions, mask_info, self.args.index_topk)
        return q_positions, mask_info, slots, chosen

    def _dsa_attention(self) -> float:
        q_positions, _, slots, chosen = self._selection()
        stack = self.entries[None]  # [1, B, 1, S, R + P]

        @functools.partial(jax.jit, donate_argnums=0)  # the stack passed through in place, not copied
        def step(stack, slots, chosen):
            view = SelectedView(stack, 0, slots, chosen)
            return stack, view.attend_latent(self.queries, q_positions, self.weights, self.scale)

        return _timed(step, stack, slots, chosen, iters=self.args.iters)

    def _dsa_indexer(self) -> float:
        q_positions, mask_info, _, _ = self._selection()

        @functools.partial(jax.jit, donate_argnums=0)
        def step(index_keys, mask_info):
            return index_keys, select_slots(self.indexer, index_keys, q_positions, mask_info, self.args.index_topk)[0]

        return _timed(step, self.index_keys[:, 0], mask_info, iters=self.args.iters)


def rows(args) -> list[dict]:
    """A row per context and case: ms per step, MiB read per step and row, and the ratio to full-head."""
    out = []
    for context in args.contexts:
        layer = _Layer(context, args)
        for case in CASES:
            seconds = layer.seconds(case)
            out.append(
                {"context": context, "case": case, "ms": 1e3 * seconds, "mib_read": step_bytes(case, context, args) / 2**20,
                 "bytes_vs_full_head": step_bytes(case, context, args) / step_bytes("full-head", context, args)}
            )  # fmt: skip
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    width = args.rank + args.rope_dim
    print(
        f"{jax.devices()[0]}, {args.dtype}, batch {args.batch}, one layer: H {args.heads}, R {args.rank}, "
        f"P {args.rope_dim}, n {args.nope_dim}; DSA D_I {args.index_dim}, {args.index_heads} indexer heads, "
        f"top-{args.index_topk}; median of {args.iters}; per token {width} latent values against "
        f"{2 * args.heads * (args.nope_dim + args.rope_dim)} full-head"
    )
    table = rows(args)
    print("| S | case | ms/step | MiB read per step and row | bytes vs full-head |")
    print("|---:|---|---:|---:|---:|")
    for row in table:
        print(
            f"| {row['context']} | {row['case']} | {row['ms']:.3f} | {row['mib_read']:.3f} | {row['bytes_vs_full_head']:.3f} |"
        )
    if args.out is not None:
        summary = {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0]), "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": table}  # fmt: skip
        args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    return 0
