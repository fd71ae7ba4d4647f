"""GGUF block formats kept quantized (``jaxkv.kernels.quantized``): the pure-JAX and the FFI
dequantization bit-exact against gguf-py's (random blocks and the shipped SmolLM2 / Gemma 3
tensors), ``quantized_matmul`` on both backends against a float64 reference (decode and prefill
row counts, a traced layer of a stack read in place under ``lax.scan``, bfloat16, vmap), the
matrix's model-facing surface (``x @ w.T``, ``w[...]``, stack indexing, ``reshape``) and the errors.

The FFI tests need the native library: they fail (never skip) when it is missing or stale, unless
there is no C++ compiler to build it."""

from __future__ import annotations

import functools
import glob
import os
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels import native
from jaxkv.kernels import quantized as q

FORMATS = sorted(q.FORMATS)
# Real tensors of the shipped files: (model, tensor name) per format, rows read (None: all).
REAL = {
    "q4_1": ("smollm2", "blk.0.ffn_down.weight"),
    "q8_0": ("smollm2", "token_embd.weight"),
    "q4_k": ("gemma3", "blk.0.attn_output.weight"),
    "q5_0": ("gemma3", "blk.0.attn_q.weight"),
    "q6_k": ("gemma3", "blk.0.ffn_down.weight"),
}
REAL_ROWS = 384
GEMMA_Q8_0 = ("gemma3", "blk.0.attn_v.weight")


@pytest.fixture(scope="module")
def ffi():
    """The FFI kernels must be there; skipped only when there is no compiler to build them."""
    if q._target(q._MATMUL) and q._target(q._DEQUANTIZE):
        return
    built = glob.glob(os.path.join(os.path.dirname(native.__file__), "_cpu*.so"))
    if not native.available() and not built and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: jaxkv's CPU kernels are not built")
    pytest.fail(f"jaxkv's quantized CPU kernels are missing (library {built or 'not built'}, "
                f"available={native.available()}): rebuild with `python setup.py build_ext --inplace`")  # fmt: skip


def _ggml(format: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[format.upper()]


def _halves(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random finite float16 values (normal, subnormal and zero among them) as bytes [n, 2]."""
    h = (rng.standard_normal(n) * 10.0 ** rng.integers(-7, 3, n)).astype(np.float16)
    h[rng.random(n) < 0.02] = 0
    assert np.isfinite(h).all()
    return h.view(np.uint8).reshape(n, 2)


def random_blocks(format: str, *shape: int, seed: int = 0) -> np.ndarray:
    """Random valid blocks uint8 [*shape[:-1], row_bytes] of ``shape[-1]`` columns: random codes,
    random finite float16 scales."""
    rng = np.random.default_rng(seed)
    values, nbytes = q.FORMATS[format]
    *lead, columns = shape
    b = rng.integers(0, 256, (int(np.prod(lead)) * (columns // values), nbytes), dtype=np.uint8)
    for offset in {"q4_1": (0, 2), "q4_k": (0, 2), "q6_k": (208,)}.get(format, (0,)):
        b[:, offset : offset + 2] = _halves(rng, len(b))
    return b.reshape(*lead, columns // values * nbytes)


@functools.cache
def _tensors(model: str) -> dict[str, gguf.ReaderTensor]:
    from jaxkv.models.defaults import resolve_model

    return {t.name: t for t in gguf.GGUFReader(resolve_model(model)).tensors}


def _tensor(model: str, name: str) -> gguf.ReaderTensor:
    return _tensors(model)[name]


def _ffi_dequantize(blocks, format: str, layer: int = 0) -> np.ndarray:
    rows, columns = blocks.shape[-2], blocks.shape[-1] // q.FORMATS[format][1] * q.FORMATS[format][0]
    fn = jax.jit(lambda b, i: q._ffi_dequantize(b, i, format, rows, columns))
    return np.asarray(fn(jnp.asarray(blocks), jnp.int32(layer)))


def test_formats_are_ggml_s():
    for format, sizes in q.FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[_ggml(format)] == sizes
        assert q.format_of(_ggml(format)) == format
    assert q.format_of(gguf.GGMLQuantizationType.F32) is None
    assert q.format_of(gguf.GGMLQuantizationType.Q5_K) is None


@pytest.mark.parametrize("format", FORMATS)
def test_dequantize_random_blocks_bit_exact(format, ffi):
    columns = 2 * q.FORMATS[format][0]
    blocks = random_blocks(format, 2, 3, 40, columns, seed=FORMATS.index(format))
    want = gguf.quants.dequantize(blocks, _ggml(format))
    got = jax.jit(lambda b: q.dequantize(b, format, columns))(blocks)
    assert got.dtype == jnp.float32 and got.shape == (2, 3, 40, columns)
    assert np.array_equal(np.asarray(got), want, equal_nan=True)
    stack = blocks.reshape(6, 40, -1)
    for layer in (0, 4):  # the kernel reads a layer of the (flattened) stack in place
        assert np.array_equal(_ffi_dequantize(stack, format, layer), want.reshape(6, 40, columns)[layer])


@pytest.mark.parametrize("format", [*REAL, "q8_0 gemma3"])
def test_dequantize_real_tensors_bit_exact(format, ffi):
    model, name = GEMMA_Q8_0 if format == "q8_0 gemma3" else REAL[format]
    tensor = _tensor(model, name)
    format = format.split()[0]
    assert q.format_of(tensor.tensor_type) == format
    blocks = np.asarray(tensor.data[:REAL_ROWS])
    want = gguf.quants.dequantize(blocks, tensor.tensor_type)
    w = q.from_gguf_tensor(tensor)
    assert w.shape == (tensor.data.shape[0], int(tensor.shape[0]))
    assert np.array_equal(np.asarray(jax.jit(lambda b: q.dequantize(b, format, w.columns))(blocks)), want)
    assert np.array_equal(_ffi_dequantize(blocks, format), want)


def _reference(x, blocks, format) -> np.ndarray:
    return np.asarray(x, np.float64) @ gguf.quants.dequantize(np.asarray(blocks), _ggml(format)).astype(np.float64).T


def _assert_close(got, want, tol=1e-5):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= tol * scale, np.abs(got - want).max() / scale


# Activation rows: the one-pass kernel up to GEMV_ROWS (tiles of 8 rows: 17 = 8 + 8 + 1), the
# dequantize kernel and XLA's dot above.
ROW_COUNTS = (1, 3, 8, 17, q.GEMV_ROWS, q.GEMV_ROWS + 1, 64)


@pytest.mark.parametrize("backend", ["ffi", "jax"])
@pytest.mark.parametrize("format", FORMATS)
def test_matmul_against_float64(format, backend, request):
    if backend == "ffi":
        request.getfixturevalue("ffi")
    assert 17 <= q.GEMV_ROWS < 64
    rows, columns = 37, 3 * q.FORMATS[format][0]  # rows: not a multiple of the kernel's row tiles
    blocks = random_blocks(format, rows, columns, seed=7)
    w = q.QuantizedMatrix(jnp.asarray(blocks), format, columns)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((n, columns)).astype(np.float32) for n in ROW_COUNTS]
    xs[1] = xs[1].reshape(3, 1, columns)  # leading axes flattened to rows and back
    got = jax.jit(lambda xs, w: [q.quantized_matmul(x, w, backend=backend) for x in xs])(xs, w)
    for x, out in zip(xs, got):
        assert out.dtype == jnp.float32 and out.shape == (*x.shape[:-1], rows)
        _assert_close(out, _reference(x, blocks, format))


@pytest.mark.parametrize("backend", ["ffi", "jax"])
def test_matmul_layer_of_a_stack_in_scan(backend, request):
    """A traced layer of a stack closed over by ``lax.scan``: each step multiplies its own layer;
    the FFI is given the whole stack (no slice of it in the program)."""
    if backend == "ffi":
        request.getfixturevalue("ffi")
    format, layers, rows, columns = "q4_k", 3, 24, 512
    stack = random_blocks(format, layers, rows, columns, seed=3)
    w = q.QuantizedMatrix(jnp.asarray(stack), format, columns)
    xs = np.random.default_rng(2).standard_normal((layers, 2, columns)).astype(np.float32)
    xs_prefill = np.random.default_rng(4).standard_normal((layers, q.GEMV_ROWS + 1, columns)).astype(np.float32)

    def run(xs, xs_prefill):
        def step(_, inputs):
            i, x, x_prefill = inputs
            layer = w.at_layer(i)
            assert layer.shape == (rows, columns) and w[i].shape == (rows, columns)
            decode = x @ layer.T if backend == "ffi" else q.quantized_matmul(x, layer, backend=backend)  # auto: ffi
            return None, (decode, q.quantized_matmul(x_prefill, w[i], backend=backend))

        return jax.lax.scan(step, None, (jnp.arange(layers, dtype=jnp.int32), xs, xs_prefill))[1]

    fn = jax.jit(run)
    if backend == "ffi":
        hlo = fn.lower(xs, xs_prefill).as_text()
        assert "custom_call" in hlo
        assert not [line for line in hlo.splitlines() if "slice" in line and "ui8" in line]  # the stack unsliced
    decode, prefill = fn(xs, xs_prefill)
    for i in range(layers):
        _assert_close(decode[i], _reference(xs[i], stack[i], format))
        _assert_close(prefill[i], _reference(xs_prefill[i], stack[i], format))


@pytest.mark.parametrize("backend", ["ffi", "jax"])
def test_matmul_bfloat16(backend, request):
    if backend == "ffi":
        request.getfixturevalue("ffi")
    blocks = random_blocks("q4_1", 40, 128, seed=5)
    w = q.QuantizedMatrix(jnp.asarray(blocks), "q4_1", 128)
    rng = np.random.default_rng(6)
    for n in (2, q.GEMV_ROWS + 3):
        x = jnp.asarray(rng.standard_normal((n, 128)), jnp.bfloat16)
        out = jax.jit(lambda x, w: q.quantized_matmul(x, w, backend=backend))(x, w)
        assert out.dtype == jnp.bfloat16 and out.shape == (n, 40)
        _assert_close(out.astype(jnp.float32), _reference(np.asarray(x, np.float32), blocks, "q4_1"), 1e-2)


def test_matmul_vmap_over_x_folds_rows(ffi):
    blocks = random_blocks("q8_0", 33, 96, seed=8)
    w = q.QuantizedMatrix(jnp.asarray(blocks), "q8_0", 96)
    x = np.random.default_rng(9).standard_normal((5, 2, 96)).astype(np.float32)
    fn = jax.jit(jax.vmap(lambda x: q.quantized_matmul(x, w, backend="ffi")))
    assert fn.lower(x).as_text().count("custom_call") == 1  # one kernel call for the 10 rows
    _assert_close(fn(x), _reference(x, blocks, "q8_0"))
    stack = q.QuantizedMatrix(jnp.asarray(random_blocks("q8_0", 2, 33, 96, seed=8)), "q8_0", 96)
    per_layer = jax.jit(jax.vmap(lambda i, x: q.quantized_matmul(x, stack.at_layer(i), backend="ffi")))
    got = per_layer(jnp.arange(2, dtype=jnp.int32), x[:2])
    for i in range(2):
        _assert_close(got[i], _reference(x[i], np.asarray(stack.blocks[i]), "q8_0"))


def test_auto_backend_and_rmatmul(ffi):
    blocks = random_blocks("q5_0", 20, 64, seed=10)
    w = q.QuantizedMatrix(jnp.asarray(blocks), "q5_0", 64)
    x = np.random.default_rng(11).standard_normal((4, 64)).astype(np.float32)
    assert q._resolve("auto") == "ffi"
    want = _reference(x, blocks, "q5_0")
    _assert_close(jnp.asarray(x) @ w.T, want)  # a jax array on the left defers to w.T
    _assert_close(x @ w.T, want)  # numpy too
    _assert_close(jax.jit(lambda x, w: x @ w.T)(x, w), want)
    assert w.T.shape == (64, 20) and w.T.T is w
    with pytest.raises(TypeError, match="x @ w.T"):
        jnp.asarray(x[:, :20]) @ w


def test_matrix_surface():
    blocks = jnp.asarray(random_blocks("q4_0", 4, 6, 10, 64, seed=12))
    w = q.QuantizedMatrix(blocks, "q4_0", 64)
    assert w.shape == (4, 6, 10, 64) and w.ndim == 4 and w.dtype == jnp.float32 and w.nbytes == blocks.size
    assert w[...] is w
    assert w[:2].shape == (2, 6, 10, 64) and w[3].shape == (6, 10, 64) and w[1, 2:4, ...].shape == (2, 10, 64)
    assert w[:3].reshape(3, 2, 3, 10, 64).shape == (3, 2, 3, 10, 64)
    flat = w.reshape(-1, 10, 64)
    assert flat.shape == (24, 10, 64)
    full = w.dequantize()
    assert full.shape == (4, 6, 10, 64)
    assert np.array_equal(flat.at_layer(7).dequantize(), full[1, 1])
    assert np.array_equal(jax.jit(lambda w, i: w[i].dequantize())(flat, jnp.int32(9)), full[1, 3])
    assert flat[jnp.int32(2)].layer is not None and flat[2].layer is not None  # read in place
    assert np.array_equal(flat[2].dequantize(), full[0, 2]) and w[3].shape == (6, 10, 64) and w[3].layer is None
    leaves, tree = jax.tree.flatten(flat.at_layer(1))
    assert len(leaves) == 2 and jax.tree.unflatten(tree, leaves).shape == (10, 64)
    assert jax.tree.map(lambda a: None, w).format == "q4_0"  # placeholder leaves pass the checks
    ids = jnp.array([[3], [7]])
    assert np.array_equal(w[0, 0].take_rows(ids), full[0, 0][ids])
    assert np.array_equal(jax.jit(lambda w, ids: w[...][ids])(w[1, 2], ids), full[1, 2][ids])  # an embedding lookup
    assert q.is_quantized(w) and not q.is_quantized(full)
    for bad in (lambda: w[:, :, 1], lambda: w[..., 1], lambda: w[0, 0, 0], lambda: flat.at_layer(0)[0],
                lambda: w[0, 0][:, 3]):  # fmt: skip
        with pytest.raises(IndexError):
            bad()
    with pytest.raises(ValueError, match="reshape"):
        w.reshape(4, 6, 640)
    with pytest.raises(ValueError, match="at_layer"):
        w.at_layer(0)
    with pytest.raises(IndexError):
        flat.at_layer(24)
    with pytest.raises(ValueError, match="^w: a stack"):
        q.quantized_matmul(jnp.ones((1, 64)), w)


def test_errors_name_the_argument(ffi):
    blocks = jnp.asarray(random_blocks("q8_0", 4, 64))
    for make, argument in [
        (lambda: q.QuantizedMatrix(blocks, "q8_1", 64), "format"),
        (lambda: q.QuantizedMatrix(blocks, "Q8_0", 64), "format"),
        (lambda: q.QuantizedMatrix(blocks, "q8_0", 48), "columns"),
        (lambda: q.QuantizedMatrix(blocks, "q8_0", 96), "blocks"),
        (lambda: q.QuantizedMatrix(blocks.view(jnp.int8), "q8_0", 64), "blocks"),
        (lambda: q.QuantizedMatrix(blocks[0], "q8_0", 64), "blocks"),
        (lambda: q.dequantize(blocks, "q4_k", 64), "columns"),
        (lambda: q.dequantize(blocks[:, :60], "q8_0", 64), "blocks"),
        (lambda: q.quantize(np.ones((4, 48)), "q8_0"), "array"),
        (lambda: q.quantize(np.ones((4, 256)), "q4_k"), "format"),
        (lambda: q.quantize(np.ones((4, 64)), "int8"), "format"),
        (lambda: q.quantized_matmul(jnp.ones((2, 32)), q.QuantizedMatrix(blocks, "q8_0", 64)), "x"),
        (lambda: q.quantized_matmul(jnp.ones((2, 64)), q.QuantizedMatrix(blocks, "q8_0", 64), backend="x"), "backend"),
    ]:
        with pytest.raises(ValueError, match=f"^{argument}:"):
            make()
    stack = q.QuantizedMatrix(jnp.asarray(random_blocks("q8_0", 2, 4, 64)), "q8_0", 64)
    layer_of = jax.jit(lambda i: q.quantized_matmul(jnp.ones((1, 64)), stack.at_layer(i), backend="ffi"))
    with pytest.raises(Exception, match="layer 5 out of range"):  # checked by the kernel
        layer_of(5).block_until_ready()


@pytest.mark.parametrize("format", ["q8_0", "q4_0", "q4_1", "q5_0"])
def test_quantize_is_gguf_s(format):
    a = np.random.default_rng(13).standard_normal((2, 5, 64)).astype(np.float32)
    w = q.quantize(jnp.asarray(a), format)
    assert w.format == format and w.shape == (2, 5, 64)
    assert np.array_equal(np.asarray(w.blocks), gguf.quants.quantize(a, _ggml(format)))
    step = {"q8_0": 1 / 127, "q4_0": 1 / 7, "q4_1": 1 / 15, "q5_0": 1 / 15}[format]
    assert np.abs(np.asarray(w.dequantize()) - a).max() <= step * np.abs(a).max()


def _mixed_stack(columns: int = 512, rows: int = 24) -> tuple[q.QuantizedMatrix, list[np.ndarray], tuple[str, ...]]:
    formats = ("q6_k", "q4_k", "q6_k", "q8_0")
    layers = [random_blocks(f, rows, columns, seed=20 + i) for i, f in enumerate(formats)]
    return q.stack_layers(list(formats), layers, columns), layers, formats


def test_mixed_stack_layers():
    """A stack whose layers differ in format (Gemma 3's Q4_K_M files): padded rows, per-layer formats."""
    w, layers, formats = _mixed_stack()
    assert w.format == formats and w.shape == (4, 24, 512) and isinstance(w.blocks, np.ndarray)
    assert w.blocks.shape[-1] == q.row_columns(w.blocks.shape[-1], formats) // 32 * 34  # q8_0's rows: the widest
    assert q.row_columns(1680, ("q6_k", "q4_k")) == 2048 and q.row_columns(360, "q4_1") == 576
    full = np.asarray(w.dequantize())
    for i, (f, blocks) in enumerate(zip(formats, layers)):
        want = gguf.quants.dequantize(blocks, _ggml(f))
        assert np.array_equal(full[i], want)
        assert np.array_equal(jax.jit(lambda w, i: w.at_layer(i).dequantize())(w, jnp.int32(i)), want)
    assert w[0:3:2].format == "q6_k" and w[0:3:2].blocks.shape == (2, 24, 420)  # cut to its own rows
    assert w[1:3].format == ("q4_k", "q6_k") and np.array_equal(w[1:3].dequantize(), full[1:3])
    uniform = q.stack_layers(["q4_1"] * 2, [random_blocks("q4_1", 3, 64, seed=i) for i in range(2)], 64)
    assert uniform.format == "q4_1" and uniform.blocks.shape == (2, 3, 40)
    with pytest.raises(ValueError, match="^rows:"):
        q.stack_layers(["q4_1"], [], 64)
    with pytest.raises(ValueError, match="^row_bytes:"):
        q.row_columns(101, "q4_1")
    with pytest.raises(ValueError, match="^blocks:"):
        q.QuantizedMatrix(w.blocks[:3], formats, 512)  # 3 matrices, 4 formats


@pytest.mark.parametrize("backend", ["ffi", "jax"])
def test_mixed_stack_matmul_in_scan(backend, request):
    if backend == "ffi":
        request.getfixturevalue("ffi")
    w, layers, formats = _mixed_stack()
    w = jax.tree.map(jnp.asarray, w)
    rng = np.random.default_rng(21)
    xs, xs_prefill = rng.standard_normal((4, 3, 512)), rng.standard_normal((4, q.GEMV_ROWS + 1, 512))

    def step(_, inputs):
        i, x, x_prefill = inputs
        return None, tuple(q.quantized_matmul(a, w[i], backend=backend) for a in (x, x_prefill))

    run = jax.jit(lambda *xs: jax.lax.scan(step, None, (jnp.arange(4, dtype=jnp.int32), *xs))[1])
    decode, prefill = run(xs.astype(np.float32), xs_prefill.astype(np.float32))
    for i, (f, blocks) in enumerate(zip(formats, layers)):
        _assert_close(decode[i], _reference(xs[i].astype(np.float32), blocks, f))
        _assert_close(prefill[i], _reference(xs_prefill[i].astype(np.float32), blocks, f))


def test_mixed_real_gemma_layers(ffi):
    """Gemma 3's ffn_down: Q6_K and Q4_K layers stacked, a traced layer through the kernel."""
    tensors = [_tensor("gemma3", f"blk.{i}.ffn_down.weight") for i in range(4)]
    formats = [q.format_of(t.tensor_type) for t in tensors]
    assert len(set(formats)) == 2
    w = q.stack_layers(formats, [np.asarray(t.data) for t in tensors], int(tensors[0].shape[0]))
    x = np.random.default_rng(22).standard_normal((2, w.columns)).astype(np.float32)
    fn = jax.jit(lambda x, i: q.quantized_matmul(x, w[i], backend="ffi"))
    for i, t in enumerate(tensors):
        _assert_close(fn(x, jnp.int32(i)), _reference(x, np.asarray(t.data), formats[i]))
