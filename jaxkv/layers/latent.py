"""MLA's latent cache (DeepSeek-V2/V3): per token the normalised latent (``kv_lora_rank``) and the
shared RoPE key (``qk_rope_head_dim``), ``R + P`` values instead of per-head K/V (DeepSeek-V3: 576
against 32,768 for its 128 full heads). The storage, the two attention forms (absorbed, plain)
and the measured rule between them: ``jaxkv.mla``.
"""

from __future__ import annotations

from jaxkv.mla import GrowingSlots, LatentPages, LatentStorage
from jaxkv.protocol import pytree_class


@pytree_class
class LatentLayer(LatentStorage):
    """MLA latent entries in a fixed buffer ``[B, 1, S_max, R + P]``: the normalised latent, then the shared RoPE key.

    ``update(keys, values, positions)``: ``keys`` are the new tokens' entries ``[B, 1, T, R + P]``;
    ``values`` must be None (the latent is key and value both). Slot ``p`` holds position ``p``,
    as in ``StaticLayer`` (overflow under jit: dropped and reported by ``overflowed``); the view
    it returns reads the entries in either form (``jaxkv.mla.LatentView.attend_latent``).
    """

    MEMORY_FORMULA = "B·S_max·(R_kv+P)·bytes + 4·B"


@pytree_class
class DynamicLatentLayer(GrowingSlots, LatentLayer):
    """MLA latent entries in a buffer ``[B, 1, N, R + P]`` whose capacity N grows (``GrowingSlots``)."""

    MEMORY_FORMULA = "B·bucket(S)·(R_kv+P)·bytes + 4·B, bucket = next power of 2 (eager: exactly S)"


@pytree_class
class PagedLatentLayer(LatentPages):
    """MLA latent entries in pages ``[P, page_size, 1, R + P]`` of the full pool, shared by all rows.

    The serving engine's variant (``jaxkv.mla.LatentPages``): prefix caching, forks, preemption
    and swaps as for ``PagedLayer``."""

    MEMORY_FORMULA = "P·page·(R_kv+P)·bytes; P pages (all rows share them)"
