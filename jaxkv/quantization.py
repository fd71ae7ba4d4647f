"""Quantization of K/V values: ``QuantSpec`` (int8/4/2 or fp8 codes with float16 group scales)
and the functions that quantize and dequantize ``[..., S, D]`` values. Shared by the layers
that store quantized K/V (``jaxkv.layers.quantized``'s ring and buffer with a residual,
``jaxkv.layers.paged``'s pages); see ``jaxkv.layers.quantized`` for the formats' rationale."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct
from pydantic import ConfigDict

from jaxkv.sharding import HEAD_DIM, Axes

PER_TOKEN, PER_CHANNEL = 0, -1
FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
FORMATS = ("int", *FP8_DTYPES)
INT_BITS = (2, 4, 8)
SCALE_DTYPE = jnp.float16


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How a ``QuantizedLayer`` stores K/V; see the module docstring and each field's."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # a config key that is no field is an error

    nbits: int | None = None
    """Bits per value: 2, 4 or 8 for 'int' (None: 4, the reference default); 8 or None for fp8."""
    format: Literal[FORMATS] = "int"
    """'int' (asymmetric, with a zero point) or 'e4m3' / 'e5m2' (fp8, symmetric)."""
    axis_key: int = PER_TOKEN
    """How keys are grouped: 0 per token, -1 per channel."""
    axis_value: int = PER_TOKEN
    """How values are grouped: 0 per token, -1 per channel."""
    q_group_size: int = 64
    """Values per scale group."""
    residual_length: int = 128
    """Full-precision tokens kept per row (a multiple of ``q_group_size`` when an axis is per channel)."""

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"QuantSpec: format must be one of {FORMATS}, got {self.format!r}")
        if self.format == "int" and self.nbits not in (None, *INT_BITS):
            raise ValueError(f"QuantSpec: int nbits must be one of {INT_BITS}, got {self.nbits}")
        if self.format != "int" and self.nbits not in (None, 8):
            raise ValueError(
                f"QuantSpec: fp8 format {self.format!r} stores 8 bits; drop nbits or set it to 8, got {self.nbits}"
            )
        for name, axis in (("axis_key", self.axis_key), ("axis_value", self.axis_value)):
            if axis not in (PER_TOKEN, PER_CHANNEL):
                raise ValueError(f"QuantSpec: {name} must be 0 (per token) or -1 (per channel), got {axis!r}")
        if self.q_group_size <= 0:
            raise ValueError(f"QuantSpec: q_group_size must be positive, got {self.q_group_size}")
        if self.residual_length < 0:
            raise ValueError(f"QuantSpec: residual_length must be >= 0, got {self.residual_length}")
        if PER_CHANNEL in (self.axis_key, self.axis_value) and (
            self.residual_length == 0 or self.residual_length % self.q_group_size
        ):
            raise ValueError(
                f"QuantSpec: a per-channel axis quantizes whole groups of {self.q_group_size} tokens, so "
                f"residual_length must be a positive multiple of q_group_size, got {self.residual_length}"
            )

    @property
    def bits(self) -> int:
        return self.nbits or (4 if self.format == "int" else 8)

    @property
    def asymmetric(self) -> bool:
        """Int codes carry a zero point; fp8 is symmetric around zero."""
        return self.format == "int"

    @property
    def number_dtype(self):
        """What a code means: uint8 (int codes, packed) or the fp8 format's float8."""
        return jnp.dtype(FP8_DTYPES.get(self.format, jnp.uint8))

    # Codes are stored as uint8 for every format; fp8 codes are float8 bit patterns, bitcast
    # (free) on write and read. XLA's CPU scatter has no float8 kernel: a float8 buffer
    # updated in a loop was widened to float16 and narrowed back whole, every layer of every
    # step (2.5x the full-precision time of a 1k-token perplexity window on SmolLM2).
    code_dtype = jnp.dtype(jnp.uint8)

    def check_head_dim(self, head_dim: int) -> None:
        per_byte = 8 // self.bits
        if head_dim % per_byte:
            raise ValueError(
                f"QuantSpec: {self.bits}-bit codes pack {per_byte} per byte; head_dim {head_dim} is not a multiple"
            )
        if PER_TOKEN in (self.axis_key, self.axis_value) and head_dim % self.q_group_size:
            raise ValueError(
                f"QuantSpec: per-token groups split head_dim {head_dim} into groups of {self.q_group_size}; "
                f"pick a q_group_size that divides it"
            )


class QuantizedTensor(struct.PyTreeNode):
    """Codes and group scales of ``[..., S, D]`` values; see ``quantize``.

    ``codes``: ``[..., S, D·bits/8]`` uint8: packed int codes, or float8 bit patterns (fp8). ``scales``
    and ``zeros`` (int only; None for fp8): ``[..., S, D/G]`` per token or
    ``[..., ceil(S/G), D]`` per channel, float16.
    """

    codes: jax.Array
    scales: jax.Array
    zeros: jax.Array | None

    def logical_axes(self, *lead: str) -> QuantizedTensor:
        """The tensor's ``Axes``: ``lead`` names the dimensions before the last (``[..., S]``), whose
        last is the head dim (packed codes, or scale groups)."""
        axes = Axes(*lead, HEAD_DIM)
        return QuantizedTensor(axes, axes, None if self.zeros is None else axes)


def _groups(x: jax.Array, group: int, axis: int) -> tuple[jax.Array, int]:
    """``x`` ``[..., S, D]`` split into groups, and the axis each group spans."""
    *lead, length, dim = x.shape
    if axis == PER_TOKEN:
        return x.reshape(*lead, length, dim // group, group), -1
    return x.reshape(*lead, length // group, group, dim), -2


def _pack(codes: jax.Array, bits: int) -> jax.Array:
    """uint8 codes ``[..., D]`` < 2**bits -> ``[..., D·bits/8]``: byte j holds codes j, j + D/k, ... (k per byte)."""
    per_byte = 8 // bits
    parts = jnp.split(codes, per_byte, axis=-1)
    return sum((part << (bits * i)).astype(jnp.uint8) for i, part in enumerate(parts)).astype(jnp.uint8)


def _unpack(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of ``_pack``: ``[..., D·bits/8]`` -> uint8 codes ``[..., D]``."""
    per_byte, mask = 8 // bits, (1 << bits) - 1
    if per_byte == 1:
        return packed
    # One broadcast shift and a reshape: a concatenate of the k parts compiles, on XLA's CPU
    # backend, to a select per value that ran int4 blocks several times slower.
    shifts = jnp.arange(0, 8, bits, dtype=jnp.uint8)[:, None]  # [k, 1]
    parts = (packed[..., None, :] >> shifts) & jnp.uint8(mask)  # [..., k, D/k]: part i holds codes i·D/k...
    return parts.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def quantize(x: jax.Array, spec: QuantSpec, axis: int) -> QuantizedTensor:
    """Quantize ``x`` ``[..., S, D]`` in groups of ``spec.q_group_size`` along ``axis`` (0 per
    token: channels of one token; -1 per channel: tokens of one channel, S a multiple of G).

    Codes are computed from the stored (float16) scale and zero point, so ``dequantize``
    inverts exactly what was rounded: the error per value is at most half a step plus
    the scale's own rounding.
    """
    x = x.astype(jnp.float32)
    grouped, reduce = _groups(x, spec.q_group_size, axis)
    if spec.asymmetric:
        low, high = jnp.min(grouped, reduce, keepdims=True), jnp.max(grouped, reduce, keepdims=True)
        scale = ((high - low) / (2**spec.bits - 1)).astype(SCALE_DTYPE)
        zero = low.astype(SCALE_DTYPE)
        step = scale.astype(jnp.float32)
        step = jnp.where(step > 0, step, 1.0)
        codes = jnp.clip(jnp.round((grouped - zero.astype(jnp.float32)) / step), 0, 2**spec.bits - 1).astype(jnp.uint8)
        codes = _pack(codes.reshape(x.shape), spec.bits)
        return QuantizedTensor(codes, scale.squeeze(reduce), zero.squeeze(reduce))
    largest = float(jnp.finfo(spec.number_dtype).max)
    scale = (jnp.max(jnp.abs(grouped), reduce, keepdims=True) / largest).astype(SCALE_DTYPE)
    step = scale.astype(jnp.float32)
    step = jnp.where(step > 0, step, 1.0)
    # e4m3fn has no infinity: a value past its largest rounds to NaN, so clip first.
    codes = jnp.clip(grouped / step, -largest, largest).astype(spec.number_dtype)
    codes = jax.lax.bitcast_convert_type(codes, spec.code_dtype)
    return QuantizedTensor(codes.reshape(x.shape), scale.squeeze(reduce), None)


def expand_scales(scales: jax.Array, group: int, axis: int) -> jax.Array:
    """Group scales -> one per value ``[..., S, D]`` (per channel: ceil(S/G) rows -> G each)."""
    return jnp.repeat(scales, group, axis=-1 if axis == PER_TOKEN else -2)


def decode_codes(codes: jax.Array, scales: jax.Array, zeros: jax.Array | None, spec: QuantSpec) -> jax.Array:
    """Values ``[..., S, D]`` float32 from codes and per-value ``scales``/``zeros`` ``[..., S, D]``."""
    numbers = _unpack(codes, spec.bits) if spec.asymmetric else jax.lax.bitcast_convert_type(codes, spec.number_dtype)
    values = numbers.astype(jnp.float32) * scales.astype(jnp.float32)
    return values if zeros is None else values + zeros.astype(jnp.float32)


def dequantize(q: QuantizedTensor, spec: QuantSpec, axis: int, dtype=jnp.float32) -> jax.Array:
    """Inverse of ``quantize``: ``[..., S, D]`` in ``dtype``."""
    length = q.codes.shape[-2]

    def per_value(s):
        return None if s is None else expand_scales(s, spec.q_group_size, axis)[..., :length, :]

    return decode_codes(q.codes, per_value(q.scales), per_value(q.zeros), spec).astype(dtype)


def empty_quantized(batch_size, num_kv_heads, head_dim, slots, spec: QuantSpec, axis: int) -> QuantizedTensor:
    """Zeros for ``slots`` tokens: the allocated dtypes are the packed codes' and float16."""
    lead = (batch_size, num_kv_heads)
    code_dim = head_dim * spec.bits // 8
    scale_shape = (*lead, slots, head_dim // spec.q_group_size) if axis == PER_TOKEN else (
        *lead, math.ceil(slots / spec.q_group_size), head_dim)  # fmt: skip
    zeros = jnp.zeros(scale_shape, SCALE_DTYPE) if spec.asymmetric else None
    return QuantizedTensor(
        jnp.zeros((*lead, slots, code_dim), spec.code_dtype), jnp.zeros(scale_shape, SCALE_DTYPE), zeros
    )
