"""Attention kernels behind jaxkv's views: the attention backend names and their resolution
(``backends``), and adapters from jaxkv's page pools to the Pallas paged-attention kernels JAX
ships (``paged``). On a platform other than the kernel's (CPU in the tests) a kernel runs in
Pallas interpret mode. See docs/kernels.md."""

from jaxkv.kernels.backends import AUTO, BACKENDS, PALLAS_GPU, PALLAS_TPU, XLA, check_backend, resolve_backend
from jaxkv.kernels.paged import heads_major, kernel_decode, kernel_route, paged_decode, token_tables

__all__ = [
    "AUTO", "BACKENDS", "PALLAS_GPU", "PALLAS_TPU", "XLA", "check_backend", "heads_major", "kernel_decode",
    "kernel_route", "paged_decode", "resolve_backend", "token_tables",
]  # fmt: skip
