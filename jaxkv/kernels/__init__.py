"""Attention kernels behind jaxkv's views: the attention backend names and their resolution
(``backends``), adapters from jaxkv's page pools to the Pallas paged-attention kernels JAX
ships and to jaxkv's native CPU kernel (``paged``; ``cpu_paged``: the kernel's FFI call), and the
GPU kernels for dense buffers (``dense``: ``generate``'s caches). On a platform other than the
kernel's (CPU in the tests) a Pallas kernel runs in Pallas interpret mode. See docs/kernels.md."""

from jaxkv.kernels.backends import AUTO, BACKENDS, CPU, PALLAS_GPU, PALLAS_TPU, XLA, check_backend, resolve_backend
from jaxkv.kernels.paged import (
    HEADS_LAYOUT,
    POOL_LAYOUTS,
    TOKENS_LAYOUT,
    check_layout,
    flat_tables,
    heads_major,
    kernel_decode,
    kernel_route,
    paged_blocks,
    paged_decode,
    prefill_route,
    slot_and_head_axes,
    split_pool,
)  # fmt: skip

__all__ = [
    "AUTO", "BACKENDS", "CPU", "HEADS_LAYOUT", "PALLAS_GPU", "PALLAS_TPU", "POOL_LAYOUTS", "TOKENS_LAYOUT", "XLA",
    "check_backend", "check_layout", "flat_tables", "heads_major", "kernel_decode", "kernel_route", "paged_blocks",
    "paged_decode", "prefill_route", "resolve_backend", "slot_and_head_axes", "split_pool",
]  # fmt: skip
