"""The native CPU paged-attention kernel (``attention_backend='cpu'``: jaxkv/kernels/cpu/paged_attention.cc
through ``jax.ffi``) against jaxkv's XLA paged read of the same pools under ``jit`` (within 1e-5 in
float32) and against a NumPy reference: both pool layouts, GQA, ragged lengths with a length-0 row
and a padding token (position -1), rows' pages out of order with garbage past each length and on
the null page, sliding windows, soft-capping, bfloat16 pages, int codes with zero points (8, 4 and
2 bits, several scale groups per token) and fp8 codes, a token with its drafts, prefill blocks,
head dims that fill whole vectors and ones that do not, split partitions; the routing to XLA; the
backend's resolution; and the engine's greedy tokens (tiny Llama and Gemma 3, SmolLM2) against
the XLA engine's and ``generate``'s.

The kernels are part of the install (``setup.py``); where the library was not built (no compiler)
the module is skipped with that reason, and a library built without this kernel fails here."""

import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.models.load import load_pretrained

from jaxkv.batch import QUERY_BLOCK
from jaxkv.kernels import (
    CPU,
    HEADS_LAYOUT,
    PALLAS_GPU,
    POOL_LAYOUTS,
    TOKENS_LAYOUT,
    XLA,
    cpu_paged,
    kernel_route,
    native,
    paged_blocks,
    prefill_route,
    resolve_backend,
)
from jaxkv.kernels.dense import dense_route
from jaxkv.layers.paged import NULL_PAGE, PagedKVView, table_width
from jaxkv.quantization import PER_TOKEN, QuantSpec, quantize
from jaxkv.serving import Engine
from jaxkv.sharding import Layout, make_mesh
from tests.cases import (
    RAGGED_LENGTHS,
    RAGGED_PAGE,
    RAGGED_TOKEN_ROWS,
    TINY_GEMMA,
    TINY_LLAMA,
    greedy_reference,
    ragged_tables,
    run_arrivals,
)  # fmt: skip

if native.library() is None:
    pytest.skip("jaxkv's native CPU kernels were not built here (no C++ compiler at install)", allow_module_level=True)
assert cpu_paged.target() is not None  # a built library without the kernel raises here: a stale build

HQ, HKV, PAGES = 6, 2, 16  # G = 3 query heads per K/V head
PAGE, LENGTHS, TOKEN_ROWS = RAGGED_PAGE, RAGGED_LENGTHS, RAGGED_TOKEN_ROWS  # row 1 decodes padding
WIDTH = table_width(32, PAGE)
POSITIONS = LENGTHS[TOKEN_ROWS] - 1  # each decode token's position (-1: padding)
TOLERANCE = 1e-5
GARBAGE = 1e3  # on the null page and past each row's length: never read
QUANTIZED = {
    "int8": QuantSpec(nbits=8, q_group_size=8, residual_length=0),  # zero points, two groups per token at D 16
    "int4": QuantSpec(nbits=4, q_group_size=16, residual_length=0),
    "int2": QuantSpec(nbits=2, q_group_size=4, residual_length=0),
    "e4m3": QuantSpec(format="e4m3", q_group_size=16, residual_length=0),  # the Pallas kernels' one scale per token
    "e5m2": QuantSpec(format="e5m2", q_group_size=8, residual_length=0),
}
PLAIN = {"window": None, "decode_width": 1, "shifted": False, "slot_mass": False, "quantization": None, "head_dim": 16}


def _tables() -> np.ndarray:
    return ragged_tables(WIDTH)


def _pools(dim: int, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Keys and values ``[P, page, H_kv, D]``: random where rows hold tokens, ``GARBAGE`` elsewhere."""
    keys, values = jax.random.normal(jax.random.key(dim), (2, PAGES, PAGE, HKV, dim))
    held = np.zeros((PAGES, PAGE), bool)
    for row, length in enumerate(LENGTHS):
        for slot in range(length):
            held[_tables()[row, slot // PAGE], slot % PAGE] = True
    held = jnp.asarray(held)[:, :, None, None]
    return jnp.where(held, keys, GARBAGE).astype(dtype), jnp.where(held, values, -GARBAGE).astype(dtype)


def _stored(pool, layout: str):
    """A pool ``[P, page, H_kv, ·]`` (values, or codes and scales) as ``layout`` stores it."""
    return pool if layout == TOKENS_LAYOUT else jax.tree.map(lambda leaf: leaf.swapaxes(1, 2), pool)


def _stack(pool, layout: str):
    """Layer 1 of a stack of 2 (layer 0: the pool reversed, so a wrong layer offset shows)."""
    return jax.tree.map(lambda leaf: jnp.stack([leaf[::-1], leaf]), _stored(pool, layout))


def _attend(backend, keys, values, queries, positions, rows, *, decode_tokens, decode_width=1, layout=TOKENS_LAYOUT,
            quantization=None, window=None, logit_softcap=None):  # fmt: skip
    """A view of layer 1 of a stack of 2 over ``rows`` ``[N]``, its ``queries`` ``[N, H_q, D]`` at
    ``positions`` ``[N]`` (the first ``decode_tokens`` decoding) read under ``jit``: ``[N, H_q, D]``."""

    @jax.jit
    def read(key_stack, value_stack, queries):
        view = PagedKVView(
            key_stack, value_stack, 1, jnp.asarray(_tables()), jnp.asarray(rows), decode_tokens=decode_tokens,
            decode_width=decode_width, window=window, quantization=quantization, backend=backend, layout=layout,
        )  # fmt: skip
        out = view.attend(queries.transpose(1, 0, 2)[None], jnp.asarray(positions)[None], scale=dim**-0.5,
                          logit_softcap=logit_softcap)  # fmt: skip
        return out[0].transpose(1, 0, 2)

    dim = queries.shape[-1]
    return read(_stack(keys, layout), _stack(values, layout), queries)


def _dequantized(pool, spec: QuantSpec | None) -> np.ndarray:
    """NumPy's float32 values of a pool ``[P, page, H_kv, ·]`` (codes unpacked and scaled by hand)."""
    if spec is None:
        return np.asarray(pool.astype(jnp.float32))
    codes, scales = np.asarray(pool.codes), np.asarray(pool.scales).astype(np.float32)
    if spec.asymmetric:
        per_byte = 8 // spec.bits
        numbers = np.concatenate([(codes >> (spec.bits * i)) & ((1 << spec.bits) - 1) for i in range(per_byte)], -1)
    else:
        numbers = codes.view({"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[spec.format])
    values = numbers.astype(np.float32) * np.repeat(scales, spec.q_group_size, axis=-1)
    if pool.zeros is None:
        return values
    return values + np.repeat(np.asarray(pool.zeros, np.float32), spec.q_group_size, axis=-1)


def _reference(keys, values, queries, positions, rows, *, window=None, logit_softcap=None) -> np.ndarray:
    """NumPy: each query at position q over its row's slots of positions ``0 .. q`` (those > q - window),
    held on pages other than the null page; ``[N, H_q, D]`` float64."""
    queries = np.asarray(queries, np.float64)
    out = np.zeros(queries.shape)
    group = queries.shape[1] // keys.shape[2]
    for n, (position, row) in enumerate(zip(positions, rows)):
        slots = [s for s in range(position + 1) if (window is None or s > position - window)]
        pages = _tables()[row, [s // PAGE for s in slots]]
        slots = [(page, s % PAGE) for page, s in zip(pages, slots) if page != NULL_PAGE]
        if not slots:
            continue
        for head in range(queries.shape[1]):
            k = np.stack([keys[page, s, head // group] for page, s in slots]).astype(np.float64)
            v = np.stack([values[page, s, head // group] for page, s in slots]).astype(np.float64)
            logits = k @ queries[n, head] * queries.shape[-1] ** -0.5
            if logit_softcap is not None:
                logits = logit_softcap * np.tanh(logits / logit_softcap)
            weights = np.exp(logits - logits.max())
            out[n, head] = weights @ v / weights.sum()
    return out


def _queries(count: int, dim: int) -> jax.Array:
    return jax.random.normal(jax.random.key(100 + dim), (count, HQ, dim))


def _check(backend_out, xla_out, reference):
    np.testing.assert_allclose(backend_out, xla_out, atol=TOLERANCE, rtol=TOLERANCE)
    np.testing.assert_allclose(backend_out, reference, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("layout", POOL_LAYOUTS)
@pytest.mark.parametrize("dim", [16, 24, 64])
@pytest.mark.parametrize("window, logit_softcap", [(None, None), (6, None), (None, 5.0)])
def test_decode_tokens_equal_the_xla_read_and_numpy(layout, dim, window, logit_softcap):
    """Ragged rows (a padding token of a length-0 row), GQA, garbage on the null page and past each
    length, either layout, head dims of whole vectors and not (24), a sliding window (a row reads
    positions > q - window; row 2's window starts mid-page) or soft-capping: the kernel equals XLA's
    read and NumPy's within 1e-5; the padding token gets zeros."""
    keys, values = _pools(dim)
    queries = _queries(len(TOKEN_ROWS), dim)
    options = {"window": window, "logit_softcap": logit_softcap}
    read = {b: _attend(b, keys, values, queries, POSITIONS, TOKEN_ROWS, decode_tokens=len(TOKEN_ROWS), layout=layout,
                       **options) for b in (CPU, XLA)}  # fmt: skip
    assert read[CPU].shape == queries.shape and read[CPU].dtype == jnp.float32
    _check(read[CPU], read[XLA], _reference(keys, values, queries, POSITIONS, TOKEN_ROWS, **options))
    assert np.all(np.asarray(read[CPU])[TOKEN_ROWS == 1] == 0)


@pytest.mark.parametrize("layout", POOL_LAYOUTS)
@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_pages_equal_the_xla_read_and_numpy(layout, name):
    """Int codes with zero points (8, 4, 2 bits packed; one or several scale groups per token) and
    fp8 codes (e4m3, e5m2) with their float16 scales: dequantized in the kernel as jaxkv
    dequantizes them; equal to XLA's read and to NumPy's dequantization within 1e-5."""
    spec = QUANTIZED[name]
    keys, values = (quantize(x, spec, PER_TOKEN) for x in _pools(16))
    assert kernel_route(CPU, **PLAIN | {"quantization": spec}) is None
    queries = _queries(len(TOKEN_ROWS), 16)
    read = {b: _attend(b, keys, values, queries, POSITIONS, TOKEN_ROWS, decode_tokens=len(TOKEN_ROWS), layout=layout,
                       quantization=spec) for b in (CPU, XLA)}  # fmt: skip
    reference = _reference(_dequantized(keys, spec), _dequantized(values, spec), queries, POSITIONS, TOKEN_ROWS)
    _check(read[CPU], read[XLA], reference)


def test_bfloat16_pages():
    """bfloat16 pages are widened exactly and read in float32: NumPy's float32 read of the same
    values within 1e-5; XLA's read within bfloat16's rounding (it weighs the values in bfloat16)."""
    keys, values = _pools(16, jnp.bfloat16)
    queries = _queries(len(TOKEN_ROWS), 16)
    read = {b: _attend(b, keys, values, queries, POSITIONS, TOKEN_ROWS, decode_tokens=len(TOKEN_ROWS))
            for b in (CPU, XLA)}  # fmt: skip
    reference = _reference(_dequantized(keys, None), _dequantized(values, None), queries, POSITIONS, TOKEN_ROWS)
    np.testing.assert_allclose(read[CPU], reference, atol=TOLERANCE, rtol=TOLERANCE)
    np.testing.assert_allclose(read[CPU], read[XLA], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("layout", POOL_LAYOUTS)
@pytest.mark.parametrize("window", [None, 5])
def test_drafts_and_prefill_blocks(layout, window):
    """A mixed step: two blocks of a token and its draft (``decode_width`` 2: causal among them; one
    block padding), then a prefill block of ``QUERY_BLOCK`` queries of row 2 (positions 3 .. 12, the
    rest padding). The kernel reads both parts (``kernel_route`` and ``prefill_route`` give them to
    it) and equals XLA's read and NumPy's, with a window too."""
    keys, values = _pools(16)
    decode_positions, decode_rows = np.array([7, 8, -1, -1]), np.array([0, 0, 1, 1])
    prefill_positions = np.full(QUERY_BLOCK, -1)
    prefill_positions[:10] = np.arange(3, 13)
    positions = np.concatenate([decode_positions, prefill_positions]).astype(np.int32)
    rows = np.concatenate([decode_rows, np.full(QUERY_BLOCK, 2)]).astype(np.int32)
    queries = _queries(len(rows), 16)
    options = {"decode_tokens": 4, "decode_width": 2, "layout": layout, "window": window}
    view = PagedKVView(*_stack(keys, layout), 1, _tables(), rows, decode_tokens=4, decode_width=2, window=window,
                       backend=CPU, layout=layout)  # fmt: skip
    assert view.kernel_route(16, slot_mass=False) is None and view.prefill_route(slot_mass=False) is None
    read = {b: _attend(b, keys, values, queries, positions, rows, **options) for b in (CPU, XLA)}
    _check(read[CPU], read[XLA], _reference(keys, values, queries, positions, rows, window=window))


def test_partitions_merge_to_the_whole_read():
    """Few blocks on the pool's threads: a row's slots are split into partitions (down to one page)
    whose softmax states are merged; the result equals the unsplit read and NumPy's."""
    keys, values = _pools(64)
    positions, rows = np.array([[15], [8]], np.int32), np.array([2, 0])
    queries = _queries(2, 64)
    stacks = _stack(keys, TOKENS_LAYOUT), _stack(values, TOKENS_LAYOUT)

    def read(min_partition):
        call = jax.jit(lambda q, k, v: cpu_paged.paged_attention(
            q[:, None], positions, k, v, 1, _tables()[rows], scale=64**-0.5, min_partition=min_partition))
        return call(queries, *stacks)[:, 0]  # fmt: skip

    split, whole = read(PAGE), read(0)
    np.testing.assert_allclose(split, whole, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(split, _reference(keys, values, queries, positions[:, 0], rows), atol=TOLERANCE)


def test_bad_operands_are_errors_not_reads():
    """A block-table entry that is no page of the pool, or a layer past the stack: an error from the
    kernel (XLA raises it), never a read outside the pool."""
    keys, values = (_stack(x, TOKENS_LAYOUT) for x in _pools(16))
    tables = _tables()[TOKEN_ROWS]
    tables[0, 0] = PAGES
    read = lambda tables, index: cpu_paged.paged_attention(  # noqa: E731
        _queries(4, 16)[:, None], POSITIONS[:, None], keys, values, index, tables, scale=0.25).block_until_ready()
    with pytest.raises(Exception, match="not a page of the pool"):
        read(tables, 1)
    with pytest.raises(Exception, match="layer index out of range"):
        read(_tables()[TOKEN_ROWS], 2)


def test_routing_names_what_the_kernel_lacks():
    """The CPU kernel reads windows, drafts, prefill blocks and every page format; compacted rows,
    slot scores and pages split over devices go to XLA, each with its reason."""
    assert kernel_route(CPU, **PLAIN) is None and prefill_route(CPU, shifted=False, slot_mass=False) is None
    for feature in ({"window": 8}, {"decode_width": 3}, {"quantization": QUANTIZED["int2"]}):
        assert kernel_route(CPU, **PLAIN | feature) is None, feature
    assert kernel_route(CPU, **PLAIN | {"shifted": True}).startswith("compacted rows")
    assert kernel_route(CPU, **PLAIN | {"slot_mass": True}).startswith("slot scores")
    assert kernel_route(CPU, **PLAIN | {"split_pool": True}).startswith("pages split over devices")
    assert prefill_route(CPU, shifted=True, slot_mass=False).startswith("compacted rows")
    assert prefill_route(CPU, shifted=False, slot_mass=False, split_pool=True).startswith("pages split")
    assert prefill_route(PALLAS_GPU, shifted=False, slot_mass=False) and prefill_route(XLA, shifted=False,
                                                                                        slot_mass=False)  # fmt: skip
    assert dense_route(CPU, num_queries=1, num_slots=64, dtype=jnp.float32, logit_softcap=None, slot_mass=False)


def test_backend_resolution(monkeypatch, caplog):
    """``auto`` on CPU is the native kernel; with the kernels switched off (``JAXKV_CPU_KERNELS=0``)
    it is XLA, said once, and naming ``cpu`` is refused; ``cpu`` on another platform is refused."""
    assert resolve_backend("auto", "cpu") == CPU and resolve_backend(CPU, "cpu") == CPU
    with pytest.raises(ValueError, match="runs on the cpu platform"):
        resolve_backend(CPU, "gpu")
    monkeypatch.setenv(native.SWITCH, "0")
    for cached in (native.library, native.target):
        cached.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="jaxkv.kernels.backends"):
            assert resolve_backend("auto", "cpu") == XLA
        assert [r.getMessage() for r in caplog.records if r.name == "jaxkv.kernels.backends"] == [
            "attention_backend auto: the native CPU kernels are off, using xla"]  # fmt: skip
        with pytest.raises(ValueError, match="kernels are off"):
            resolve_backend(CPU, "cpu")
    finally:
        monkeypatch.delenv(native.SWITCH)
        for cached in (native.library, native.target):
            cached.cache_clear()
    assert cpu_paged.available()


@pytest.mark.parametrize("layout", POOL_LAYOUTS)
def test_per_device_over_the_heads_of_a_mesh(layout):
    """K/V heads over ``model`` (2 host devices, one K/V head and its query heads each): the kernel
    runs per device under ``shard_map`` and equals the unsharded read."""
    mesh = make_mesh({"data": 1, "model": 2}, jax.devices()[:2])
    keys, values = _pools(16)
    queries = _queries(len(TOKEN_ROWS), 16)[:, None]
    stacks = _stack(keys, layout), _stack(values, layout)
    options = {"scale": 0.25, "layout": layout}
    tables, positions = _tables()[TOKEN_ROWS], POSITIONS[:, None]
    whole = paged_blocks(queries, positions, *stacks, 1, tables, **options)
    sharded = jax.jit(lambda *a: paged_blocks(*a, sharding=Layout.create(mesh), **options))(
        queries, positions, *stacks, 1, tables)  # fmt: skip
    np.testing.assert_allclose(sharded, whole, atol=1e-6, rtol=1e-6)


def _traced(monkeypatch) -> list[int]:
    """Records each kernel call's query block size (1: decode tokens, ``QUERY_BLOCK``: prefill)."""
    calls, kernel = [], cpu_paged.paged_attention
    monkeypatch.setattr(cpu_paged, "paged_attention", lambda q, *a, **kw: calls.append(q.shape[1]) or kernel(q, *a,
                                                                                                             **kw))
    return calls


@pytest.mark.parametrize("kind, layout, quantization", [
    ("llama", TOKENS_LAYOUT, None), ("llama", HEADS_LAYOUT, QUANTIZED["int8"]), ("gemma3", HEADS_LAYOUT, None),
])  # fmt: skip
def test_engine_greedy_tokens_equal_xla(kind, layout, quantization, monkeypatch):
    """Tiny Llama (plain and int8 pages) and tiny Gemma 3 (its sliding layers' windows read by the
    kernel) served with ``attention_backend='cpu'``: decode tokens and prefill chunks traced into
    the kernel; the same greedy tokens as the XLA engine (and, unquantized, as ``generate``)."""
    model = Llama(LlamaConfig(**TINY_LLAMA)) if kind == "llama" else Gemma3(Gemma3Config(**TINY_GEMMA))
    prompts = [[3, 14, 15, 9, 26, 5], [35, 8, 9], [(7 * i) % 50 + 1 for i in range(37)]]
    options = {"kv_memory": 64 * 1024, "page_size": 4, "max_num_seqs": 3, "max_num_batched_tokens": 16,
               "pool_layout": layout, "quantization": quantization}  # fmt: skip
    calls = _traced(monkeypatch)
    tokens = {b: run_arrivals(Engine(model, attention_backend=b, **options), prompts, [0, 1, 1], 6) for b in (CPU, XLA)}
    assert tokens[CPU] == tokens[XLA]
    assert set(calls) == {1, QUERY_BLOCK}
    if quantization is None:
        assert tokens[CPU] == greedy_reference(model, prompts, 6)


def test_smollm2_greedy_tokens_equal_xla():
    """SmolLM2-135M: four requests of different lengths, the CPU kernel's engine and XLA's give the
    same greedy tokens."""
    model, tokenizer = load_pretrained("smollm2")
    texts = ["The capital of France is", "List three facts about bees.", "Once upon a time, " * 12, "def add(a, b):"]
    prompts = [tokenizer.encode(text) for text in texts]
    tokens = {}
    for backend in (CPU, XLA):
        engine = Engine(model, kv_memory="16MiB", max_num_seqs=4, max_num_batched_tokens=64, attention_backend=backend)
        tokens[backend] = run_arrivals(engine, prompts, [0, 0, 1, 2], 8)
    assert tokens[CPU] == tokens[XLA]
