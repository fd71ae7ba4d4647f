"""What every paged layer shares about the engine's block tables (``jaxkv.layers.paged``'s K/V
pages, ``jaxkv.mla``'s latent pages): the null page, the pool names and where a packed token is
written."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NULL_PAGE = 0
FULL_POOL, SLIDING_POOL = "full", "sliding"


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
