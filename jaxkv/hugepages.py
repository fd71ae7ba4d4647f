"""Weights in host memory backed by 2 MiB pages (Linux transparent huge pages).

Why: a decode step streams every weight once. On CPU, read through 4 KiB pages, that stream
misses the TLB on almost every page, and in a virtual machine each miss walks two page tables.
Measured on the 2-core VM (SmolLM2-135M float32, batch 1, the default scanned model, fresh
processes): 28.6 / 31.8 / 32.3 tok/s with the weights on 4 KiB pages, 57.8 / 58.1 / 59.5 tok/s
on huge pages. Most distributions give huge pages only where a program asks for them
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise``), so a process got them only
when the kernel's background collapsing happened to reach its buffers: the scanned model's
"fast and slow processes".

``on_huge_pages(array)`` copies a host (CPU) array into a fresh anonymous mapping that asks for
huge pages before its first touch (``MADV_HUGEPAGE``: the first write then faults in whole
2 MiB pages), and hands that memory to JAX without a copy (``jax.device_put`` aliases aligned
host memory on CPU). Collapsing an existing buffer (``MADV_COLLAPSE``) was tried first: it fails
with EAGAIN once memory is fragmented, and with EINVAL on XLA's own allocations. Arrays under
2 MiB, arrays on an accelerator or sharded over several devices, and other systems are left as
they are.
"""

from __future__ import annotations

import mmap
import sys

import jax
import jax.numpy as jnp
import numpy as np

HUGE_PAGE = 2 << 20


def on_huge_pages(array) -> jax.Array:
    """``array`` (a host array, or a jax array on one CPU device) as a jax array whose memory asks
    for huge pages; anything else unchanged (a jax array) or placed as usual (a host array)."""
    if isinstance(array, jax.Array) and not on_one_cpu(array):
        return array
    if np.size(array) * np.dtype(array.dtype).itemsize < HUGE_PAGE or not huge_pages_apply():
        return jnp.asarray(array)
    host = np.asarray(array)
    mapping = mmap.mmap(-1, host.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the copy faults in huge pages
    backed = np.frombuffer(mapping, dtype=host.dtype, count=host.size).reshape(host.shape)
    np.copyto(backed, host)
    return jax.device_put(backed)  # aliases the mapping (page-aligned), which the array keeps alive


def on_one_cpu(array: jax.Array) -> bool:
    devices = array.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def huge_pages_apply() -> bool:
    """Linux (``MADV_HUGEPAGE``), and host arrays go to the CPU backend by default."""
    return sys.platform.startswith("linux") and jax.default_backend() == "cpu"
