"""MLA's latent cache (DeepSeek-V2/V3): per token the normalised latent (``kv_lora_rank``) and the
shared RoPE key (``qk_rope_head_dim``), ``R + P`` values instead of per-head K/V (DeepSeek-V3: 576
against 32,768 for its 128 full heads). The storage, the two attention forms (absorbed, plain)
and the measured rule between them: ``jaxkv.mla``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.mla import GrowingSlots, LatentPages, LatentSpec, LatentStorage
from jaxkv.protocol import check_array, entry, pytree_class, write_slots
from jaxkv.quantization import PER_TOKEN, QuantizedTensor, QuantSpec, dequantize, empty_quantized, quantize
from jaxkv.sharding import BATCH, KV_HEADS, KV_SLOTS, Axes


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
class QuantizedLatentLayer(LatentLayer):
    """MLA latent entries stored 8-bit per token: codes ``[B, 1, S_max, R + P]`` and group scales.

    ``quantization``: a ``QuantSpec`` of 8 bits ('int' with a zero point, or fp8 'e4m3' / 'e5m2')
    in per-token groups of ``q_group_size`` values (a divisor of ``R + P``; one that also divides
    ``R`` keeps the latent's and the RoPE key's ranges apart) and no residual. Entries are quantized
    as they are written; a step dequantizes the entry's buffer and attends as ``LatentLayer``
    (``(R + P)·(1 + z/G)`` bytes a token against ``(R + P)·bytes``: 3.8x less than float32 for int8
    with G 64; what a step reads from it too, plus the dequantized copy it writes for attention).
    """

    latent: QuantizedTensor  # codes [B, 1, S_max, R + P] uint8, scales (and int zeros) [B, 1, S_max, (R + P) / G]
    quantization: QuantSpec = struct.field(pytree_node=False)

    MEMORY_FORMULA = "B·S_max·(R_kv+P)·(1 + z/G) + 4·B; z = 4 (int8: f16 scale + zero) or 2 (fp8: f16 scale), G group"

    @classmethod
    def create(cls, batch_size: int, spec: LatentSpec, max_length: int, dtype=jnp.float32, *, quantization=None):
        if quantization is None:
            raise ValueError(f"{cls.__name__} needs quantization=QuantSpec(nbits=8, ...)")
        _check_latent_quantization(quantization, spec.width)
        if max_length <= 0:
            raise ValueError(f"{cls.__name__}: max_length must be positive, got {max_length}")
        return cls(
            latent=empty_quantized(batch_size, 1, spec.width, max_length, quantization, PER_TOKEN),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            quantization=quantization,
        )

    @classmethod
    def kv_bytes(cls, batch_size, seq_len, num_kv_heads, head_dim, dtype, max_length=None, *, latent, quantization,
                 **_) -> int:  # fmt: skip
        """Bytes for a buffer of ``max_length`` (default ``seq_len``) slots; ``latent`` a ``LatentSpec``."""
        scale_bytes = 4 if quantization.asymmetric else 2
        per_token = latent.width + latent.width // quantization.q_group_size * scale_bytes
        return batch_size * (max_length or seq_len) * per_token + 4 * batch_size

    @property
    def capacity(self) -> int:
        return self.latent.codes.shape[-2]

    def logical_axes(self):
        return self.replace(latent=self.latent.logical_axes(BATCH, KV_HEADS, KV_SLOTS), lengths=Axes(BATCH))

    def describe(self) -> str:
        return f"{self.quantization.format}{self.quantization.bits}"

    def _checked_tokens(self, what: str, x: jax.Array | None, field: str = "latent") -> jax.Array:
        layout, codes = ("B", "1", "T", "R + P"), self.latent.codes
        if x is None:
            raise ValueError(f"{type(self).__name__}.update: {what} is None, expected [{', '.join(layout)}]")
        expected = (codes.shape[-4], 1, None, codes.shape[-1])
        check_array(f"{type(self).__name__}.update", what, x, layout, expected, x.dtype)  # any float dtype
        return x

    def _write_field(self, name: str, index, x: jax.Array, slots) -> QuantizedTensor:
        stored = quantize(x, self.quantization, PER_TOKEN)
        return jax.tree.map(lambda leaf, new: write_slots(leaf, index, new, slots), self.latent, stored)

    def _read_entries(self, index) -> tuple[jax.Array, int]:
        found = jax.tree.map(lambda leaf: entry(leaf, index), self.latent)
        return dequantize(found, self.quantization, PER_TOKEN)[None], 0


def _check_latent_quantization(spec: QuantSpec, width: int) -> None:
    """What a quantized latent supports: 8 bits, per-token groups dividing ``width`` (R + P), no residual."""
    if spec.bits != 8 or spec.axis_key != PER_TOKEN or spec.residual_length:
        raise ValueError(
            "QuantizedLatentLayer stores 8-bit per-token codes without a residual: "
            f"QuantSpec(nbits=8, axis_key=0, residual_length=0), got {spec}"
        )
    if width % spec.q_group_size:
        raise ValueError(f"QuantizedLatentLayer: q_group_size {spec.q_group_size} must divide R + P = {width}")


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
