"""Sizes shared across the library: capacity buckets and human-readable byte counts."""

from __future__ import annotations

MIN_BUCKET = 16


def bucket(n: int) -> int:
    """Capacity bucket for ``n`` tokens: the next power of two, at least ``MIN_BUCKET``.

    Growing caches and padded prompts round up to buckets, so a run of lengths meets
    O(log n) distinct shapes (and compiles)."""
    return max(MIN_BUCKET, 1 << max(0, int(n) - 1).bit_length())


def human_bytes(num_bytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: B, KiB, MiB, then GiB."""
    if num_bytes < 1024:
        return f"{num_bytes:.0f} B"
    for unit in ("KiB", "MiB"):
        num_bytes /= 1024
        if num_bytes < 1024:
            return f"{num_bytes:.1f} {unit}"
    return f"{num_bytes / 1024:.2f} GiB"
