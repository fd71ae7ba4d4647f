"""Back large host arrays with 2 MiB pages (Linux transparent huge pages).

Why: a decode step streams every weight once. On CPU, read through 4 KiB pages, that stream
misses the TLB on almost every page; in a virtual machine each miss walks two page tables.
Measured on the 2-core VM (SmolLM2-135M float32, batch 1, the default scanned model):
28.6 / 31.8 / 32.3 tok/s in three fresh processes with the weights on 4 KiB pages, 57.8 /
58.1 / 59.5 tok/s with them collapsed into huge pages. The kernel gives huge pages only where
asked (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` on most distributions),
so a process got them only when khugepaged happened to collapse its buffers: the scanned
model's "fast and slow processes".

``use_huge_pages(array)`` asks for them (``MADV_HUGEPAGE``) and collapses the array's whole
2 MiB pages now (``MADV_COLLAPSE``, Linux 6.1+). Anonymous memory only: a view of a file's
memory map (the weight cache's float32 tensors) stays on the page cache's small pages, so
models copy their weights out of it first. Elsewhere (another OS, an accelerator's memory, THP
disabled) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import jax

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25


@functools.cache
def _madvise():
    """libc's ``madvise``, or None where there is none to call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def use_huge_pages(array: jax.Array) -> int:
    """Back ``array``'s whole 2 MiB pages with huge pages where it lives in host memory; returns
    the bytes collapsed (0 when nothing could be: a small or non-host array, no THP)."""
    madvise = _madvise()
    if madvise is None or not isinstance(array, jax.Array) or not array.is_fully_addressable:
        return 0
    collapsed = 0
    for shard in array.addressable_shards:
        if shard.device.platform != "cpu":
            continue
        start = shard.data.unsafe_buffer_pointer()
        low, high = -(-start // HUGE_PAGE) * HUGE_PAGE, (start + shard.data.nbytes) // HUGE_PAGE * HUGE_PAGE
        if high > low and madvise(low, high - low, MADV_HUGEPAGE) == 0 and madvise(low, high - low, MADV_COLLAPSE) == 0:
            collapsed += high - low
    return collapsed
