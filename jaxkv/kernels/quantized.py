"""GGUF (ggml) block formats kept quantized as model weights, and their matmuls.

A quantized GGUF tensor is rows of blocks: each block holds ``block_values`` consecutive values of
a row as small integer codes with one or a few float16 scales (``FORMATS``; byte layouts exactly
ggml's, as gguf-py reads them). ``QuantizedMatrix`` keeps such a tensor's raw bytes on the device
(``blocks`` uint8 ``[*stack, rows, row_bytes]``) and stands in for the float ``[*stack, rows,
columns]`` weight in model code: ``x @ w.T`` multiplies through ``quantized_matmul``, ``w[...]``,
``w[:depth]``, ``w.at_layer(i)`` and ``w.reshape(...)`` work on the stack axes.

Two ways to multiply (``quantized_matmul(..., backend=)``):

* ``"jax"``: dequantize in the jitted function (``dequantize``, pure jnp, bit-exact against
  gguf-py's float32 numpy) and a float32 dot; on a GPU/TPU XLA fuses the dequantization into the
  dot. The path of every non-CPU platform and the fallback.
* ``"ffi"``: jaxkv's native CPU kernels (``jaxkv/kernels/cpu/quant.cc``, XLA FFI). Up to
  ``GEMV_ROWS`` activation rows (decode): one pass over the blocks, each block decoded once to
  float32 in registers and FMA'd with every row. More rows (prefill): the kernel dequantizes the
  matrix to float32 ``[rows, columns]`` and XLA's dot multiplies. A layer of a stacked matrix is
  read in place (the whole stack and the layer index go to the kernel: no slice copy).

A stack may mix formats, one per layer (``format`` a tuple: Gemma 3's Q4_K_M files mix Q4_K and
Q6_K ``ffn_down`` layers, Q5_0 and Q8_0 ``attn_v``; ``stack_layers``): each layer's rows are padded
with zero bytes to the widest layer's, and the kernels pick a layer's format by its index.

``"auto"`` (default) is ``"ffi"`` on CPU when the kernels are built (``jaxkv.kernels.native``),
else ``"jax"``. Both compute ``x @ w.dequantize().T`` in float32 (the kernel's sums in another order:
within float32 rounding). ``quantize`` makes ``q8_0`` / ``q4_0`` / ``q4_1`` / ``q5_0`` matrices from
float weights (gguf-py's quantizer, host side). See docs/kernels.md, "Quantized weights".
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import flax.struct
import gguf
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kernels import native

logger = logging.getLogger(__name__)

# format -> (values per block, bytes per block): ggml's block formats kept quantized.
FORMATS: dict[str, tuple[int, int]] = {
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q4_k": (256, 144),
    "q6_k": (256, 210),
}
# Activation rows up to which the FFI multiplies with its one-pass kernel (decode, short chunks);
# above, the FFI dequantizes the matrix and XLA's dot multiplies (prefill). The one-pass kernel is
# faster up to about 48 rows on SmolLM2's matrices here (docs/kernels.md, "Quantized weights").
GEMV_ROWS = 32
BACKENDS = ("auto", "ffi", "jax")
_MATMUL, _DEQUANTIZE = "JaxkvQuantMatmul", "JaxkvQuantDequantize"


def _ggml_type(format: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[format.upper()]


def format_of(ggml_type: gguf.GGMLQuantizationType) -> str | None:
    """The kept format of a GGUF tensor type (``"q4_k"`` for ``Q4_K``); None when it is not one of
    ``FORMATS`` (F32, F16, BF16 and the other quantized types: dequantize those on load)."""
    name = gguf.GGMLQuantizationType(ggml_type).name.lower()
    return name if name in FORMATS else None


def _check_format(format: Any) -> tuple[int, int]:
    if not isinstance(format, str) or format not in FORMATS:
        raise ValueError(f"format: {format!r} is not one of {sorted(FORMATS)}")
    return FORMATS[format]


def _formats(format: Any) -> tuple[str, ...]:
    """``format`` (a format, or one per layer of a mixed stack) as a tuple, each checked."""
    formats = (format,) if isinstance(format, str) else format
    if not isinstance(formats, tuple) or not formats:
        raise ValueError(f"format: {format!r} is neither a format of {sorted(FORMATS)} nor a tuple of them")
    for f in formats:
        _check_format(f)
    return formats


def _row_bytes(format: str, columns: int) -> int:
    values, nbytes = FORMATS[format]
    return columns // values * nbytes


def _check(blocks: Any, format: Any, columns: Any) -> None:
    """ValueError naming the argument unless ``blocks`` (uint8 ``[*stack, rows, row_bytes]``) holds
    rows of ``columns`` values in ``format`` (a tuple: one format per layer of the flattened stack,
    rows padded to the widest). Leaves without a shape and dtype (pytree placeholders) pass: only
    the static fields are checked then."""
    formats = _formats(format)
    if isinstance(columns, bool) or not isinstance(columns, (int, np.integer)) or columns <= 0:
        raise ValueError(f"columns: {columns!r} is not a positive int")
    for f in formats:
        if columns % FORMATS[f][0]:
            raise ValueError(f"columns: {columns} is not a multiple of {f}'s block of {FORMATS[f][0]} values")
    shape, dtype = getattr(blocks, "shape", None), getattr(blocks, "dtype", None)
    if shape is None or dtype is None:
        return
    if np.dtype(dtype) != np.uint8:
        raise ValueError(f"blocks: dtype {dtype}, expected uint8 (a GGUF tensor's raw bytes)")
    row_bytes = max(_row_bytes(f, columns) for f in formats)
    if len(shape) < 2 or shape[-1] != row_bytes:
        raise ValueError(
            f"blocks: shape {tuple(shape)}, expected [*stack, rows, {row_bytes}] ({columns} {format} values a row)"
        )
    matrices = int(np.prod(shape[:-2]))
    if not isinstance(format, str) and matrices != len(formats):
        raise ValueError(f"blocks: shape {tuple(shape)}, a stack of {matrices} matrices, for {len(formats)} formats")


def row_columns(row_bytes: int, format: str | tuple[str, ...]) -> int:
    """The values a row holds in ``row_bytes`` bytes of ``format`` (a tuple: the widest layer's)."""
    formats = _formats(format)
    columns = min(row_bytes // FORMATS[f][1] * FORMATS[f][0] for f in formats)
    if columns <= 0 or any(columns % FORMATS[f][0] for f in formats):
        raise ValueError(f"row_bytes: {row_bytes} bytes are no whole row of {format} blocks")
    if max(_row_bytes(f, columns) for f in formats) != row_bytes:
        raise ValueError(f"row_bytes: {row_bytes} bytes are no whole row of {format} blocks")
    return columns


def is_quantized(x: Any) -> bool:
    """Whether ``x`` is a ``QuantizedMatrix`` (a weight kept in its blocks)."""
    return isinstance(x, QuantizedMatrix)


# ----------------------------------------------------------------------------------------------
# Pure-JAX dequantization (gguf-py's numpy, float32, expression for expression).


def _half(b: jax.Array) -> jax.Array:
    """float16 from two little-endian bytes ``[..., 2]`` -> float32 ``[...]``."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
    """``[..., k]`` bytes -> ``[..., 2k]``: the low nibbles, then the high ones."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(b: jax.Array) -> jax.Array:
    d = _half(b[..., :2])
    x = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    return x * d[..., None]


def _q4_0(b: jax.Array) -> jax.Array:
    d = _half(b[..., :2])
    q = _nibbles(b[..., 2:]).astype(jnp.int8) - jnp.int8(8)
    return d[..., None] * q.astype(jnp.float32)


def _q4_1(b: jax.Array) -> jax.Array:
    d, m = _half(b[..., :2]), _half(b[..., 2:4])
    q = _nibbles(b[..., 4:]).astype(jnp.float32)
    return d[..., None] * q + m[..., None]


def _q5_0(b: jax.Array) -> jax.Array:
    d = _half(b[..., :2])
    qh = jax.lax.bitcast_convert_type(b[..., 2:6], jnp.uint32)
    high = ((qh[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1).astype(jnp.uint8)
    q = (_nibbles(b[..., 6:]) | (high << 4)).astype(jnp.int8) - jnp.int8(16)
    return d[..., None] * q.astype(jnp.float32)


def _q4_k(b: jax.Array) -> jax.Array:
    lead = b.shape[:-1]
    d, dmin = _half(b[..., :2]), _half(b[..., 2:4])
    s = b[..., 4:16].reshape(*lead, 3, 4)
    sd, sm, smd = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = jnp.concatenate([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], axis=-1)
    ds = d[..., None] * sc.astype(jnp.float32)  # [..., 8]
    dm = dmin[..., None] * mn.astype(jnp.float32)
    qs = b[..., 16:].reshape(*lead, 4, 1, 32)
    q = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(*lead, 8, 32).astype(jnp.float32)
    return (ds[..., None] * q - dm[..., None]).reshape(*lead, 256)


def _q6_k(b: jax.Array) -> jax.Array:
    lead = b.shape[:-1]
    ql = b[..., :128].reshape(*lead, 2, 1, 64)
    ql = jnp.concatenate([ql & 0x0F, ql >> 4], axis=-2).reshape(*lead, 8, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    qh = jnp.concatenate([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-2).reshape(*lead, 8, 32)
    q = (ql | (qh << 4)).astype(jnp.int8) - jnp.int8(32)
    q = q.reshape(*lead, 16, 16).astype(jnp.float32)
    scales = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    ds = _half(b[..., 208:210])[..., None] * scales  # [..., 16]
    return (ds[..., None] * q).reshape(*lead, 256)


_DEQUANTIZERS = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q4_k": _q4_k, "q6_k": _q6_k}


def _dequantize_one(blocks: jax.Array, format: str, columns: int) -> jax.Array:
    """float32 ``[..., columns]`` of rows ``[..., row_bytes]`` in ``format`` (padding past the row's
    blocks ignored)."""
    values, nbytes = FORMATS[format]
    lead = blocks.shape[:-1]
    rows = blocks[..., : columns // values * nbytes].reshape(*lead, columns // values, nbytes)
    return _DEQUANTIZERS[format](rows).reshape(*lead, columns)


def dequantize(
    blocks: jax.Array, format: str | tuple[str, ...], columns: int, dtype: Any = jnp.float32
) -> jax.Array:  # fmt: skip
    """The float values ``[*stack, rows, columns]`` of ``blocks`` uint8 ``[*stack, rows, row_bytes]``
    in ``format`` (pure JAX, any leading axes; float32 values bit-exact against
    ``gguf.quants.dequantize``), cast to ``dtype``. A tuple ``format`` gives each matrix of the
    flattened stack its own (rows padded to the widest)."""
    blocks = jnp.asarray(blocks)
    _check(blocks, format, columns)
    if isinstance(format, str):
        return _dequantize_one(blocks, format, columns).astype(dtype)
    flat = blocks.reshape(-1, *blocks.shape[-2:])
    pieces, order = [], []
    for f in sorted(set(format)):
        layers = [i for i, g in enumerate(format) if g == f]
        pieces.append(_dequantize_one(flat[np.array(layers)], f, columns))
        order += layers
    out = jnp.concatenate(pieces)[np.argsort(order)]
    return out.reshape(*blocks.shape[:-1], columns).astype(dtype)


def _dequantize_layer(blocks: jax.Array, layer: jax.Array, formats: tuple[str, ...], columns: int) -> jax.Array:
    """float32 ``[rows, columns]`` of matrix ``layer`` (traced) of a mixed stack ``[L, rows, row_bytes]``:
    its format chosen by ``lax.switch``."""
    distinct = sorted(set(formats))
    row = jnp.asarray(blocks)[layer]
    if len(distinct) == 1:
        return _dequantize_one(row, distinct[0], columns)
    which = jnp.asarray([distinct.index(f) for f in formats], jnp.int32)[layer]
    branches = [functools.partial(_dequantize_one, format=f, columns=columns) for f in distinct]
    return jax.lax.switch(which, branches, row)


# ----------------------------------------------------------------------------------------------
# The matrix.


def _is_int_scalar(item: Any) -> bool:
    """An int, a numpy int or an int array scalar (traced or not): what ``at_layer`` takes."""
    if isinstance(item, (bool, np.bool_)):
        return False
    if isinstance(item, (int, np.integer)):
        return True
    return isinstance(item, (jax.Array, np.ndarray)) and item.ndim == 0 and jnp.issubdtype(item.dtype, jnp.integer)


class _Transposed:
    """``w.T`` of a ``QuantizedMatrix`` w: what ``x @ w.T`` multiplies by (``quantized_matmul``)."""

    __array_ufunc__ = None  # numpy arrays on the left defer to __rmatmul__ too
    __array_priority__ = 1000

    def __init__(self, matrix: QuantizedMatrix):
        self.matrix = matrix

    @property
    def shape(self) -> tuple[int, ...]:
        *stack, rows, columns = self.matrix.shape
        return (*stack, columns, rows)

    @property
    def dtype(self):
        return self.matrix.dtype

    @property
    def ndim(self) -> int:
        return self.matrix.ndim

    @property
    def T(self) -> QuantizedMatrix:
        return self.matrix

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        return quantized_matmul(x, self.matrix)

    def __repr__(self) -> str:
        return f"{self.matrix!r}.T"


@flax.struct.dataclass
class QuantizedMatrix:
    """A float ``[*stack, rows, columns]`` weight kept in a GGUF block format (a pytree: ``blocks``
    and ``layer`` are its leaves).

    Fields:
        blocks: uint8 ``[*stack, rows, row_bytes]``, ``row_bytes = columns / block_values *
            block_bytes`` (``FORMATS``): a GGUF tensor's raw data as ``gguf.GGUFReader`` gives it
            (row r = the blocks of the row's values in order), stacked or not; a device or a host
            (numpy) array.
        format: the block format, a key of ``FORMATS`` (static); or a tuple of them, one per matrix of
            the flattened stack (a mixed stack, ``stack_layers``: ``row_bytes`` the widest layer's,
            the others' rows padded with zero bytes).
        columns: values per row (static; a multiple of the formats' block values).
        layer: None, or an int32 scalar ``[]``: this matrix is layer ``layer`` of ``blocks``
            ``[L, rows, row_bytes]`` (``at_layer``), read in place by the kernels.

    Model code reads it like the float weight: ``x @ w.T`` (``quantized_matmul``), ``w[...]``,
    ``w[:depth]`` / ``w[i]`` on the stack axes, ``w.reshape(*leading, rows, columns)``, ``w.shape``,
    ``w.dequantize()``; an unstacked table's rows ``w[ids]`` come dequantized (an embedding lookup).
    """

    blocks: jax.Array
    format: str | tuple[str, ...] = flax.struct.field(pytree_node=False)
    columns: int = flax.struct.field(pytree_node=False)
    layer: jax.Array | None = None

    def __post_init__(self):
        _check(self.blocks, self.format, self.columns)

    @property
    def rows(self) -> int:
        return self.blocks.shape[-2]

    @property
    def stack(self) -> tuple[int, ...]:
        """The leading axes of the matrix (``()`` with ``layer`` set)."""
        return () if self.layer is not None else tuple(self.blocks.shape[:-2])

    @property
    def shape(self) -> tuple[int, ...]:
        """``(*stack, rows, columns)``; ``(rows, columns)`` with ``layer`` set."""
        return (*self.stack, self.rows, self.columns)

    @property
    def dtype(self):
        """What it dequantizes to: float32."""
        return jnp.dtype(jnp.float32)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of ``blocks`` (the whole stack, also with ``layer`` set)."""
        return int(np.prod(self.blocks.shape))

    @property
    def T(self) -> _Transposed:
        """The transposed view: ``x @ w.T`` is ``quantized_matmul(x, w)``."""
        return _Transposed(self)

    def __rmatmul__(self, x):
        raise TypeError("x @ w with a QuantizedMatrix w [rows, columns]: jaxkv multiplies by its transpose, x @ w.T")

    def __getitem__(self, index) -> QuantizedMatrix | jax.Array:
        """``w[...]`` is ``w``. On a stack, an index on the stack axes: ``w[:depth]``, ``w[1, 2:4]``
        (``blocks`` indexed); an int (or int32 scalar, traced or not) on a one-axis stack is
        ``at_layer`` (read in place: no slice copy). On an unstacked matrix, an index on the rows:
        those rows dequantized, float32 ``[..., columns]`` (``take_rows``). Columns are never indexed."""
        items = index if isinstance(index, tuple) else (index,)
        if all(item is Ellipsis for item in items):
            return self
        if items and items[-1] is Ellipsis:
            items = items[:-1]
        if self.layer is not None:
            raise IndexError(f"QuantizedMatrix {self.shape}, a layer of a stack: index it as w[...] only")
        axes = sum(item is not None for item in items)
        if not self.stack:
            if any(item is Ellipsis or item is None for item in items) or axes != 1:
                raise IndexError(f"QuantizedMatrix {self.shape}: only its rows can be indexed, not {index!r}")
            return self.take_rows(items[0])
        if any(item is Ellipsis for item in items) or axes > len(self.stack):
            raise IndexError(
                f"QuantizedMatrix {self.shape}: only the {len(self.stack)} stack axes can be indexed, "
                f"not the rows and columns ({index!r})"
            )
        if len(self.stack) == 1 and len(items) == 1 and _is_int_scalar(items[0]):
            return self.at_layer(items[0])
        if isinstance(self.format, str):
            return self.replace(blocks=self.blocks[items])
        return _from_layers(self.blocks[items], _index_formats(self.format, self.stack, items), self.columns)

    def at_layer(self, i) -> QuantizedMatrix:
        """Layer ``i`` (an int or an int32 scalar, traced or not) of a stack ``[L, rows, columns]``, read
        in place by the kernels."""
        if self.layer is not None or self.blocks.ndim != 3:
            raise ValueError(f"at_layer: needs a stack [L, rows, columns] without a layer, got {self.shape}")
        if isinstance(i, (int, np.integer)) and not 0 <= i < self.blocks.shape[0]:
            raise IndexError(f"at_layer: layer {i} out of range for a stack of {self.blocks.shape[0]}")
        return self.replace(layer=jnp.asarray(i, jnp.int32))

    def reshape(self, *shape) -> QuantizedMatrix:
        """The stack axes reshaped: ``shape`` is ``(*leading, rows, columns)`` (one -1 allowed in
        ``leading``)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if len(shape) < 2 or tuple(shape[-2:]) != (self.rows, self.columns) or self.layer is not None:
            raise ValueError(
                f"reshape: a QuantizedMatrix {self.shape} reshapes its stack axes only, to (*leading, "
                f"{self.rows}, {self.columns}); got {shape}"
            )
        return self.replace(blocks=self.blocks.reshape(*shape[:-2], *self.blocks.shape[-2:]))

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """The float weight ``[*stack, rows, columns]`` (``[rows, columns]`` with ``layer`` set),
        pure JAX."""
        if self.layer is None:
            return dequantize(self.blocks, self.format, self.columns, dtype)
        if isinstance(self.format, str):
            return dequantize(jnp.asarray(self.blocks)[self.layer], self.format, self.columns, dtype)
        return _dequantize_layer(self.blocks, self.layer, self.format, self.columns).astype(dtype)

    def take_rows(self, ids: Any, dtype: Any = jnp.float32) -> jax.Array:
        """Rows ``ids`` (an int array ``[...]``, an int or a slice) of an unstacked matrix,
        dequantized: ``[..., columns]`` (an embedding lookup that dequantizes only the rows it reads)."""
        if self.stack or self.layer is not None:
            raise ValueError(f"take_rows: needs an unstacked matrix [rows, columns] without a layer, got {self.shape}")
        return dequantize(jnp.asarray(self.blocks)[ids], self.format, self.columns, dtype)

    def __repr__(self) -> str:
        layer = "" if self.layer is None else f", layer of {self.blocks.shape[0]}"
        return f"QuantizedMatrix({self.format}, shape={self.shape}{layer})"


def _index_formats(formats: tuple[str, ...], stack: tuple[int, ...], items: tuple) -> tuple[str, ...]:
    """The formats of ``blocks[items]``'s matrices (``items`` on the stack axes of a mixed stack)."""
    try:
        static = tuple(i if isinstance(i, slice) or i is None else np.asarray(i) for i in items)
    except jax.errors.TracerArrayConversionError as error:
        raise IndexError(
            f"a stack of mixed formats {formats} indexed by a traced index: take a layer of a one-axis stack "
            f"(w[i], w.at_layer(i)), whose format the kernel picks"
        ) from error
    return tuple(formats[i] for i in np.ravel(np.arange(len(formats)).reshape(stack)[static]))


def _from_layers(blocks: Any, formats: tuple[str, ...], columns: int) -> QuantizedMatrix:
    """A (mixed) stack's matrices ``blocks`` in ``formats``: one format if they share it, their rows
    then cut to its bytes; else the tuple, rows cut to the widest of them."""
    widest = max(_row_bytes(f, columns) for f in formats)
    format = formats[0] if len(set(formats)) == 1 else formats
    return QuantizedMatrix(blocks[..., :widest], format, columns)


def stack_layers(formats: Sequence[str], rows: Sequence[Any], columns: int) -> QuantizedMatrix:
    """Per-layer blocks ``rows`` (uint8 ``[rows, row_bytes]`` each, host or device arrays, in
    ``formats``) as one stacked ``QuantizedMatrix`` ``[L, rows, columns]``: ``format`` the shared
    format, or (formats differing) the tuple of them, each layer's rows padded with zero bytes to the
    widest layer's (numpy arrays stay on the host)."""
    formats = tuple(formats)
    if not formats or len(formats) != len(rows):
        raise ValueError(f"rows: {len(rows)} layers for {len(formats)} formats")
    for f, r in zip(formats, rows):
        _check(r, f, columns)
        if len(r.shape) != 2:
            raise ValueError(f"rows: a layer of shape {tuple(r.shape)}, expected [rows, row_bytes]")
    host = all(isinstance(r, np.ndarray) for r in rows)
    xp = np if host else jnp
    if len(set(formats)) == 1:
        return QuantizedMatrix(xp.stack(rows), formats[0], columns)
    widest = max(_row_bytes(f, columns) for f in formats)
    padded = [xp.pad(r, ((0, 0), (0, widest - r.shape[-1]))) for r in rows]
    return QuantizedMatrix(xp.stack(padded), formats, columns)


def from_gguf_tensor(tensor: gguf.ReaderTensor) -> QuantizedMatrix | None:
    """The ``QuantizedMatrix`` of a 2-D GGUF tensor in a kept format (``gguf.GGUFReader(...).tensors``),
    its bytes copied to the default device; None for another type."""
    format = format_of(tensor.tensor_type)
    if format is None:
        return None
    return QuantizedMatrix(jnp.asarray(np.asarray(tensor.data)), format, int(tensor.shape[0]))


def quantize(array: Any, format: str) -> QuantizedMatrix:
    """``array`` float ``[*stack, rows, columns]`` (columns a multiple of 32) quantized to ``format``
    by gguf-py's quantizer (numpy, on the host): ``"q8_0"`` (int8 codes, a float16 scale per 32
    values: ``weights="int8"``), ``"q4_1"`` (4-bit codes, a float16 scale and minimum per 32:
    ``weights="int4"``), ``"q4_0"``, ``"q5_0"``. gguf-py has no quantizer for ``q4_k`` / ``q6_k``."""
    values, _ = _check_format(format)
    a = np.asarray(jax.device_get(array), dtype=np.float32)
    if a.ndim < 2:
        raise ValueError(f"array: shape {a.shape}, expected [*stack, rows, columns]")
    if a.shape[-1] % values:
        raise ValueError(f"array: {a.shape[-1]} columns is not a multiple of {format}'s block of {values} values")
    try:
        blocks = gguf.quants.quantize(a, _ggml_type(format))
    except NotImplementedError as error:
        raise ValueError(f"format: gguf-py does not implement quantizing to {format} ({error})") from error
    return QuantizedMatrix(jnp.asarray(blocks), format, a.shape[-1])


# ----------------------------------------------------------------------------------------------
# The matmul.


@functools.cache
def _target(symbol: str) -> str | None:
    """The FFI target of the kernel library's ``symbol``; None when the kernels are off or the
    library predates the symbol (then said once in a log line)."""
    try:
        return native.target(symbol)
    except AttributeError:
        logger.warning("jaxkv CPU kernels: the library has no %s (built before it? rebuild: bash scripts/setup.sh); "
                       "quantized matmuls take the pure-JAX path", symbol)  # fmt: skip
        return None


def _resolve(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    on_cpu = jax.default_backend() == "cpu"
    if backend == "auto":
        return "ffi" if on_cpu and _target(_MATMUL) and _target(_DEQUANTIZE) else "jax"
    if backend == "ffi" and not (_target(_MATMUL) and _target(_DEQUANTIZE)):
        raise RuntimeError(
            "backend='ffi': jaxkv's CPU kernels are off or lack the quantized ones (jaxkv.kernels.native)"
        )
    if backend == "ffi" and not on_cpu:
        raise ValueError(f"backend='ffi': the kernels run on CPU, JAX runs on {jax.default_backend()}")
    return backend


def _attributes(format: str | tuple[str, ...], columns: int) -> dict:
    """The kernels' attributes: the ggml type of each format (one, or one per layer), the columns."""
    codes = [_ggml_type(f).value for f in _formats(format)]
    return {"formats": np.asarray(codes, np.int32), "columns": np.int64(columns)}


def _ffi_dequantize(
    blocks: jax.Array, layer: jax.Array, format: str | tuple[str, ...], rows: int, columns: int
) -> jax.Array:  # fmt: skip
    """float32 ``[rows, columns]``: matrix ``layer`` of ``blocks`` by the dequantize kernel."""
    call = jax.ffi.ffi_call(_target(_DEQUANTIZE), jax.ShapeDtypeStruct((rows, columns), jnp.float32),
                            vmap_method="sequential")  # fmt: skip
    return call(blocks, layer, **_attributes(format, columns))


def _ffi_matmul(
    x: jax.Array, blocks: jax.Array, layer: jax.Array, format: str | tuple[str, ...], rows: int
) -> jax.Array:  # fmt: skip
    """float32 ``x [N, columns]`` @ (matrix ``layer`` of ``blocks``).T -> ``[N, rows]``: the one-pass
    kernel up to ``GEMV_ROWS`` rows, else the dequantize kernel and XLA's dot."""
    n, columns = x.shape
    if n > GEMV_ROWS:
        w = _ffi_dequantize(blocks, layer, format, rows, columns)
        return jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST)
    call = jax.ffi.ffi_call(_target(_MATMUL), jax.ShapeDtypeStruct((n, rows), jnp.float32), vmap_method="sequential")
    return call(blocks, layer, x, **_attributes(format, columns))


def _batched_ffi_matmul(format: str | tuple[str, ...], rows: int):
    """``_ffi_matmul`` whose vmap over x alone folds the batch into the rows of x (one kernel call
    for all of them); a batched matrix or layer is mapped sequentially."""

    @jax.custom_batching.custom_vmap
    def matmul(x, blocks, layer):
        return _ffi_matmul(x, blocks, layer, format, rows)

    @matmul.def_vmap
    def _rule(axis_size, in_batched, x, blocks, layer):
        x_batched, blocks_batched, layer_batched = in_batched
        if not (blocks_batched or layer_batched):
            if not x_batched:  # pragma: no cover (vmap batches something)
                return matmul(x, blocks, layer), False
            b, n, c = x.shape
            return matmul(x.reshape(b * n, c), blocks, layer).reshape(b, n, rows), True
        args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
                for a, batched in zip((x, blocks, layer), in_batched)]  # fmt: skip
        return jax.lax.map(lambda a: matmul(*a), tuple(args)), True

    return matmul


def quantized_matmul(x: jax.Array, w: QuantizedMatrix, *, backend: str = "auto") -> jax.Array:
    """``x [..., columns]`` (float32, bfloat16, float16) @ ``w.T`` -> ``[..., rows]`` in x's dtype:
    ``x @ w.dequantize().T`` computed in float32. ``w`` is one matrix (unstacked, or a layer of a
    stack: ``at_layer``). ``backend``: ``"auto"``, ``"ffi"`` (the CPU kernels), ``"jax"`` (see the
    module docstring); chosen at trace time (shapes are static)."""
    if not isinstance(w, QuantizedMatrix):
        raise TypeError(f"w: expected a QuantizedMatrix, got {type(w).__name__}")
    if w.stack:
        raise ValueError(f"w: a stack {w.shape}; multiply one matrix of it (w[i], w.at_layer(i))")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: dtype {x.dtype}, expected a float dtype")
    if x.ndim < 1 or x.shape[-1] != w.columns:
        raise ValueError(f"x: shape {x.shape}, expected [..., {w.columns}] for w {w.shape}")
    backend = _resolve(backend)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.columns).astype(jnp.float32)
    if backend == "jax":
        out = jnp.dot(x2, w.dequantize().T, precision=jax.lax.Precision.HIGHEST)
    else:
        layer = jnp.zeros((), jnp.int32) if w.layer is None else jnp.asarray(w.layer, jnp.int32)
        out = _batched_ffi_matmul(w.format, w.rows)(x2, w.blocks, layer)
    return out.reshape(*lead, w.rows).astype(x.dtype)


__all__ = [
    "BACKENDS", "FORMATS", "GEMV_ROWS", "QuantizedMatrix", "dequantize", "format_of", "from_gguf_tensor",
    "is_quantized", "quantize", "quantized_matmul", "row_columns", "stack_layers",
]  # fmt: skip
