"""The memory bandwidth the benchmarks' bounds divide by, measured in a fresh process
(``python -m jaxkv.bench.bandwidth SPEC``): the best of a numpy copy and a jitted jax sum over a
large array, or on ``--device gpu`` the sum over the GPU's memory alone."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from jaxkv.bench.common import run_as_worker, run_worker

MODULE = "jaxkv.bench.bandwidth"
TIMED_CALLS = 5  # the best of these


def measure_bandwidth(mib: int, device: str, *, label: str, timeout: float | None, verbose: bool) -> dict:
    """GB/s over an array of ``mib`` MiB (``gbps``, with the numpy copy's and the jax sum's), or
    ``{"error": ...}`` (on ``--device gpu``: when JAX finds no GPU)."""
    spec = dict(mib=mib, device=device)
    return run_worker([sys.executable, "-m", MODULE], spec, label=label, device=device, timeout=timeout,
                      verbose=verbose)  # fmt: skip


def _worker_bandwidth(spec: dict) -> dict:
    """The worker: a numpy copy (read + write) and a jitted jax sum (read); on the GPU the sum alone."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = spec["mib"] * 2**20 // 4
    x = jnp.ones(n, jnp.float32)
    if spec["device"] == "gpu":
        if jax.default_backend() != "gpu":
            raise RuntimeError(f"JAX runs on {jax.default_backend()}")
        return _jax_sum_bandwidth(x, spec["mib"], numpy_copy=None)
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    copy_s = min(_timed(lambda: np.copyto(dst, src)) for _ in range(TIMED_CALLS))
    return _jax_sum_bandwidth(x, spec["mib"], numpy_copy=2 * src.nbytes / copy_s / 1e9)


def _jax_sum_bandwidth(x, mib: int, numpy_copy: float | None) -> dict:
    """The bandwidth of a jitted sum over ``x`` (best of ``TIMED_CALLS``), next to the numpy copy's (None on a GPU)."""
    import jax
    import jax.numpy as jnp

    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    sum_s = min(_timed(lambda: total(x).block_until_ready()) for _ in range(TIMED_CALLS))
    jax_sum = x.nbytes / sum_s / 1e9
    return dict(array_mib=mib, numpy_copy_gbps=numpy_copy, jax_sum_gbps=jax_sum, gbps=max(numpy_copy or 0, jax_sum))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(run_as_worker(Path(sys.argv[1]), _worker_bandwidth))
