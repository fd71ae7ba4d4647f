"""Decode attention over paged K/V: jaxkv's XLA read against the Pallas kernels (issue 44).

    jaxkv bench attention --device gpu                     # batch 1, 8, 64 x context 1k to 32k
    python scripts/bench_attention.py --device gpu --out results/attention-h100
    jaxkv bench attention --device cpu --batch 1 2 --context 64 --heads 4 --kv-heads 2 --head-dim 16 --iters 1

One layer's pool holds ``batch`` rows of ``context`` tokens (each row's pages shuffled over the
pool); each row decodes one token at position ``context - 1``. Three paths are timed, each a
jitted ``PagedKVView.attend`` of the pool, the block table and the queries, as the engine runs it:

* ``xla``: the 'xla' backend (the engine's default) on the default 'tokens' pool
  ``[P, page, H_kv, D]``.
* ``kernel``: the platform's kernel on the 'tokens' pool: on a GPU (``attention_backend=
  'pallas_gpu'``) read in place through a table of one-token pages; on a TPU ('pallas_tpu') the
  layer's pool transposed to ``[H_kv, P, page, D]`` on every call (``jaxkv.kernels.paged``).
* ``kernel-heads``: the kernel on a 'heads' pool ``[P, H_kv, page, D]`` (``pool_layout='heads'``):
  read in place, a page per table entry.

Reported per path: ms per step (the median of ``--iters``), decode tok/s of this one layer
(``batch`` / step seconds), the K/V bytes a step must read (``batch * context * 2 * H_kv * D *
bytes``) per second, and that as a % of the HBM bandwidth: ``--hbm-gbps``, or measured as the
rate of a jitted sum over ``--bandwidth-mib`` MiB. ``--device cpu`` runs the kernels in Pallas
interpret mode: a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kernels import HEADS_LAYOUT, PALLAS_GPU, PALLAS_TPU, TOKENS_LAYOUT, XLA
from jaxkv.layers.paged import PagedKVView, table_width

DEVICES = {"gpu": PALLAS_GPU, "tpu": PALLAS_TPU, "cpu": PALLAS_GPU}  # --device -> the kernel timed (cpu: interpreted)
PATHS = ("xla", "kernel", "kernel-heads")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jaxkv bench attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=sorted(DEVICES), default="gpu", help="where JAX must run (default gpu)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="rows decoding (default 1 8 64)")
    parser.add_argument(
        "--context", type=int, nargs="+", default=[1024, 4096, 16384, 32768], help="tokens per row (default 1k-32k)"
    )
    parser.add_argument("--heads", type=int, default=32, help="query heads (default 32: Llama 3 8B)")
    parser.add_argument("--kv-heads", type=int, default=8, help="K/V heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="default 128")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("--dtype", default="bfloat16", help="K/V and query dtype (default bfloat16)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per path (default 20)")
    parser.add_argument("--hbm-gbps", type=float, help="the bandwidth the %% is of (default: measured)")
    parser.add_argument("--bandwidth-mib", type=int, default=2048, help="array the bandwidth is measured on")
    parser.add_argument("--out", type=Path, help="write OUT.json")
    args = parser.parse_args(argv)
    for name in ("batch", "context"):
        if min(getattr(args, name)) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def _median_seconds(fn, args: tuple, iters: int) -> float:
    """The median wall time of ``fn(*args)`` over ``iters`` calls, after one call that compiles."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measured_bandwidth(mib: int) -> float:
    """Bytes per second a jitted sum reads from a ``mib`` MiB array on the default device."""
    data = jnp.ones(mib * 2**20 // 4, jnp.float32)
    total = jax.jit(lambda x: jnp.sum(x))
    return data.nbytes / _median_seconds(total, (data,), 5)


def _inputs(args, batch: int, context: int, seed: int = 0) -> dict:
    """A pool ``[1, P, page, H_kv, D]`` (keys, values) holding ``batch`` rows of ``context`` tokens,
    their block tables ``[batch, W]`` (pages shuffled), positions and queries ``[1, H_q, batch, D]``."""
    dtype, page = jnp.dtype(args.dtype), args.page_size
    pages_per_row = -(-context // page)
    num_pages = batch * pages_per_row + 1  # page 0: the null page
    width = table_width(context, page)
    rng = np.random.default_rng(seed)
    tables = np.zeros((batch, width), np.int32)
    tables[:, :pages_per_row] = (1 + rng.permutation(batch * pages_per_row)).reshape(batch, pages_per_row)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    shape = (1, num_pages, page, args.kv_heads, args.head_dim)
    return {
        "keys": jax.random.normal(k1, shape, dtype),
        "values": jax.random.normal(k2, shape, dtype),
        "tables": jnp.asarray(tables),
        "positions": jnp.full((1, batch), context - 1, jnp.int32),
        "queries": jax.random.normal(k3, (1, args.heads, batch, args.head_dim), dtype),
    }


def _view_read(backend: str, scale: float, layout: str):
    """A jitted decode step of one layer through ``PagedKVView.attend`` under ``backend``, its pool
    stored in ``layout``."""

    def read(keys, values, tables, positions, queries):
        rows = jnp.arange(queries.shape[2], dtype=jnp.int32)
        view = PagedKVView(
            keys, values, 0, tables, rows, decode_tokens=queries.shape[2], backend=backend, layout=layout
        )  # fmt: skip
        return view.attend(queries, positions, scale=scale)

    return jax.jit(read)


def measure(args, batch: int, context: int, bandwidth: float) -> list[dict]:
    """One row per path for ``batch`` rows of ``context`` tokens; ``max_diff``: the largest
    difference of its output from the XLA path's (the kernels' K/V reads agree with XLA's)."""
    backend, scale = DEVICES[args.device], args.head_dim**-0.5
    data = _inputs(args, batch, context)
    common = (data["tables"], data["positions"], data["queries"])
    heads = (data["keys"].swapaxes(2, 3), data["values"].swapaxes(2, 3))  # [1, P, H_kv, page, D]
    calls = {
        "xla": (_view_read(XLA, scale, TOKENS_LAYOUT), (data["keys"], data["values"], *common)),
        "kernel": (_view_read(backend, scale, TOKENS_LAYOUT), (data["keys"], data["values"], *common)),
        "kernel-heads": (_view_read(backend, scale, HEADS_LAYOUT), (*heads, *common)),
    }
    kv_bytes = batch * context * 2 * args.kv_heads * args.head_dim * jnp.dtype(args.dtype).itemsize
    expected, rows = calls["xla"][0](*calls["xla"][1]).astype(jnp.float32), []
    for path, (fn, inputs) in calls.items():
        difference = jnp.max(jnp.abs(fn(*inputs).astype(jnp.float32) - expected))
        seconds = _median_seconds(fn, inputs, args.iters)
        rows.append({
            "path": path, "backend": XLA if path == "xla" else backend, "batch": batch, "context": context,
            "ms": 1e3 * seconds, "tok_s": batch / seconds, "gb_s": kv_bytes / seconds / 1e9,
            "hbm_pct": 100 * kv_bytes / seconds / bandwidth, "max_diff": float(difference),
        })  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = ["| batch | context | path | backend | ms/step | tok/s | K/V GB/s | % HBM | max diff |", "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['path']} | {r['backend']} | {r['ms']:.3f} | {r['tok_s']:.0f} "
            f"| {r['gb_s']:.1f} | {r['hbm_pct']:.1f} | {r['max_diff']:.1e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    platform = jax.default_backend()
    if platform != args.device:
        print(f"jaxkv bench attention: --device {args.device}, but JAX runs on {platform}", file=sys.stderr)
        return 2
    bandwidth = 1e9 * args.hbm_gbps if args.hbm_gbps else measured_bandwidth(args.bandwidth_mib)
    rows = [row for batch in args.batch for context in args.context for row in measure(args, batch, context, bandwidth)]
    device = str(jax.devices()[0].device_kind)
    print(f"decode attention, one layer: {device}, {args.heads} query / {args.kv_heads} K/V heads, head dim "
          f"{args.head_dim}, page {args.page_size}, {args.dtype}; bandwidth {bandwidth / 1e9:.0f} GB/s "
          f"({'given' if args.hbm_gbps else 'measured'})")  # fmt: skip
    print(table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": device,
            "bandwidth_gb_s": bandwidth / 1e9, "options": {k: v for k, v in vars(args).items() if k != "out"},
            "rows": rows,
        }  # fmt: skip
        args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
