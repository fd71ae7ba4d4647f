"""What every paged layer shares about the engine's block tables (``jaxkv.layers.paged``'s K/V
pages, ``jaxkv.mla``'s latent pages): the null page, the pool names, where a packed token is
written and how many pages attention reads at a time (block tables are as wide as a multiple of
that)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NULL_PAGE = 0
FULL_POOL, SLIDING_POOL = "full", "sliding"
# Slots attention reads per loop iteration (a few pages at a time): fewer iterations than one
# page at a time, while the reads stay proportional to the filled length.
ATTENTION_BLOCK_SLOTS = 128


def block_pages(page_size: int) -> int:
    """Pages attention reads per loop iteration (``ATTENTION_BLOCK_SLOTS`` slots, at least one page)."""
    return max(1, ATTENTION_BLOCK_SLOTS // page_size)


def page_slots(table, rows, positions, shifts, page_size: int) -> tuple[jax.Array, jax.Array]:
    """The page and offset ``[N]`` packed tokens at ``positions`` ``[N]`` of rows ``rows`` ``[N]`` are
    written to through ``table`` ``[R, W]``: slot ``position - shifts[row]`` of the row (``shifts``
    None: its position); padding and slots past the table's width on the null page."""
    if shifts is not None:
        positions = jnp.where(positions >= 0, positions - shifts[rows], -1)
    logical = positions // page_size
    stored = (positions >= 0) & (logical < table.shape[1])
    page = jnp.where(stored, table[rows, jnp.clip(logical, 0, table.shape[1] - 1)], NULL_PAGE)
    return page, jnp.where(stored, positions % page_size, 0)
