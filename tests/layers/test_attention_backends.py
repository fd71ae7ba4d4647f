"""Attention backends (jaxkv.kernels): each Pallas paged-attention kernel, in interpret mode on
CPU, against jaxkv's XLA paged path on the same pool; what a kernel lacks is routed to XLA; the
TPU ragged kernel's reference checks a mixed prefill-and-decode step in its interleaved layout.

Tolerances: the GPU kernel computes in float32 (within 1e-5 of XLA); the TPU kernel casts K/V
to bfloat16 (within 3e-2)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu.decode_attention import gqa
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig

import jaxkv.kernels.dense as dense_kernels
import jaxkv.layers.paged as paged_layers
import jaxkv.protocol as protocol
from jaxkv.cli.generate import cache_options, resolve_config
from jaxkv.cli.main import build_parser
from jaxkv.cli.serve import resolve_serve_config
from jaxkv.decoding.generate import generate
from jaxkv.kernels import (
    CPU,
    HEADS_LAYOUT,
    PALLAS_GPU,
    PALLAS_TPU,
    POOL_LAYOUTS,
    TOKENS_LAYOUT,
    XLA,
    check_backend,
    cpu_paged,
    flat_tables,
    heads_major,
    kernel_route,
    paged_decode,
    resolve_backend,
    split_pool,
)
from jaxkv.kernels.dense import dense_route
from jaxkv.layers.paged import NULL_PAGE, PagedKVView, PagedLayer, table_width
from jaxkv.protocol import KVView, MaskInfo, PositionalView
from jaxkv.quantization import PER_TOKEN, QuantSpec, quantize
from jaxkv.serving import Engine
from jaxkv.serving.disk_link import pool_formats
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

HQ, HKV, D, PAGES = 4, 2, 16, 16
PAGE, LENGTHS, TOKEN_ROWS = RAGGED_PAGE, RAGGED_LENGTHS, RAGGED_TOKEN_ROWS  # row 1 decodes padding
WIDTH = table_width(32, PAGE)
TOLERANCE = {PALLAS_GPU: 1e-5, PALLAS_TPU: 3e-2}
FP8 = QuantSpec(format="e4m3", q_group_size=D, residual_length=0)
# What a plain decode view tells kernel_route: every feature the kernels lack switched off.
PLAIN = {"window": None, "decode_width": 1, "shifted": False, "slot_mass": False, "quantization": None, "head_dim": D}


def _tables() -> np.ndarray:
    return ragged_tables(WIDTH)


@pytest.fixture(scope="module")
def pools():
    """Keys and values ``[P, page, H_kv, D]``; the null page and unwritten slots hold large finite garbage."""
    keys, values = jax.random.normal(jax.random.key(0), (2, PAGES, PAGE, HKV, D))
    garbage = 1e3 * jnp.ones((PAGE, HKV, D))
    return keys.at[NULL_PAGE].set(garbage), values.at[NULL_PAGE].set(-garbage)


@pytest.fixture(scope="module")
def queries():
    return jax.random.normal(jax.random.key(1), (len(TOKEN_ROWS), HQ, D))


def _positions() -> np.ndarray:
    """Each decode token's position: its row's length - 1 (-1: padding)."""
    return LENGTHS[TOKEN_ROWS] - 1


def _xla(queries, keys, values, quantization=None, window=None, logit_softcap=None) -> jax.Array:
    """jaxkv's XLA paged read of the decode tokens ``[B, H_q, D]``: ``[B, H_q, D]``."""
    view = _view(keys, values, XLA, window=window, quantization=quantization)
    q = queries.transpose(1, 0, 2)[None]  # [1, H_q, N, D]
    out = view.attend(q, jnp.asarray(_positions())[None], scale=D**-0.5, logit_softcap=logit_softcap)
    return out[0].transpose(1, 0, 2)


def _stored(pool, layout):
    """A pool ``[P, page, H_kv, ·]`` (values, or codes and scales) as ``layout`` stores it."""
    return pool if layout == TOKENS_LAYOUT else jax.tree.map(lambda leaf: leaf.swapaxes(1, 2), pool)


def _view(keys, values, backend, window=None, quantization=None, layout=TOKENS_LAYOUT) -> PagedKVView:
    """A view of one layer's pool (a stack of one, stored in ``layout``) whose decode tokens are
    ``TOKEN_ROWS``' rows."""
    stack = jax.tree.map(lambda leaf: leaf[None], (_stored(keys, layout), _stored(values, layout)))
    return PagedKVView(
        *stack, 0, jnp.asarray(_tables()), jnp.asarray(TOKEN_ROWS), decode_tokens=len(TOKEN_ROWS), window=window,
        quantization=quantization, backend=backend, layout=layout,
    )  # fmt: skip


def _kernel(backend, queries, keys, values, quantization=None, logit_softcap=None, layout=TOKENS_LAYOUT):
    """The kernel over layer 1 of a stack of 2 stored in ``layout`` (layer 0: other K/V, so a wrong
    layer offset shows)."""
    tables, lengths = _tables()[TOKEN_ROWS], np.maximum(_positions() + 1, 0)
    stacks = jax.tree.map(lambda leaf: jnp.stack([leaf[::-1], leaf]), (_stored(keys, layout), _stored(values, layout)))
    return paged_decode(
        backend, queries, *stacks, 1, jnp.asarray(tables), jnp.asarray(lengths), scale=D**-0.5,
        logit_softcap=logit_softcap, quantization=quantization, layout=layout,
    )  # fmt: skip


@pytest.mark.parametrize(
    "backend, logit_softcap, layout",
    [(PALLAS_GPU, None, TOKENS_LAYOUT), (PALLAS_GPU, 5.0, HEADS_LAYOUT), (PALLAS_TPU, None, TOKENS_LAYOUT),
     (PALLAS_TPU, None, HEADS_LAYOUT)],
)  # fmt: skip
def test_kernel_matches_the_xla_paged_read(pools, queries, backend, logit_softcap, layout):
    """Ragged lengths (a padding row included), GQA, rows' pages out of order, the null page past
    each row's pages and garbage past each length, either pool layout: the kernel agrees with
    XLA within its tolerance."""
    keys, values = pools
    expected = _xla(queries, keys, values, logit_softcap=logit_softcap)
    got = _kernel(backend, queries, keys, values, logit_softcap=logit_softcap, layout=layout)
    assert got.shape == (len(TOKEN_ROWS), HQ, D) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, atol=TOLERANCE[backend], rtol=TOLERANCE[backend])
    assert np.all(np.asarray(got)[TOKEN_ROWS == 1] == 0)  # the padding token sees nothing


@pytest.mark.parametrize("backend", [PALLAS_GPU, PALLAS_TPU])
@pytest.mark.parametrize("layout", POOL_LAYOUTS)
def test_kernel_reads_scaled_fp8_pages(pools, queries, backend, layout):
    """fp8 pages with one float16 scale per token and head: the kernel's scale path."""
    keys, values = (quantize(x, FP8, PER_TOKEN) for x in pools)
    assert kernel_route(backend, **(PLAIN | {"quantization": FP8})) is None
    expected = _xla(queries, keys, values, quantization=FP8)
    got = _kernel(backend, queries, keys, values, quantization=FP8, layout=layout)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE[backend], rtol=TOLERANCE[backend])


def test_routing_names_what_the_kernels_lack():
    """Each feature a decode kernel lacks sends the view's decode tokens to XLA, with the reason."""
    assert kernel_route(PALLAS_GPU, **PLAIN) is None and kernel_route(PALLAS_TPU, **PLAIN) is None
    lacking = {
        "window": 8, "decode_width": 3, "shifted": True, "slot_mass": True,
        "quantization": QuantSpec(nbits=8, residual_length=0),  # int codes: a zero point
    }  # fmt: skip
    for name, value in lacking.items():
        assert kernel_route(PALLAS_GPU, **(PLAIN | {name: value})), name
    groups = QuantSpec(format="e4m3", q_group_size=D // 2, residual_length=0)  # two scales per token
    assert kernel_route(PALLAS_GPU, **(PLAIN | {"quantization": groups}))
    assert kernel_route(XLA, **PLAIN) == "the xla backend"


def test_backend_names_and_auto(caplog, monkeypatch):
    """``auto`` picks the platform's kernel (on CPU the native one), else XLA with one log line; a bad
    name is refused by name."""
    assert resolve_backend("auto", "gpu") == PALLAS_GPU and resolve_backend("auto", "tpu") == PALLAS_TPU
    assert resolve_backend("auto", "cpu") == CPU  # the native library is built here
    monkeypatch.setattr(cpu_paged, "available", lambda: False)  # as without a compiler
    with caplog.at_level(logging.INFO, logger="jaxkv.kernels.backends"):
        assert resolve_backend("auto", "cpu") == XLA
    assert len(caplog.records) == 1 and "xla" in caplog.records[0].getMessage()
    with caplog.at_level(logging.INFO, logger="jaxkv.kernels.backends"):
        assert resolve_backend(PALLAS_GPU, "cpu") == PALLAS_GPU and resolve_backend(XLA, "cpu") == XLA
    assert len(caplog.records) == 2 and "interpret mode" in caplog.records[1].getMessage()
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        check_backend("cudnn")


def _ragged_pages(keys, values) -> jax.Array:
    """jaxkv's pools ``[P, page, H_kv, D]`` interleaved as the ragged kernel's ``[P, page, 2 H_kv, D]``
    (K head h at 2h, V head h at 2h + 1)."""
    return jnp.stack([keys, values], axis=3).reshape(*keys.shape[:2], 2 * keys.shape[2], keys.shape[3])


def test_ragged_reference_reads_a_mixed_step(pools):
    """A mixed step as the TPU ragged kernel takes it (a prefill chunk, then decodes; K/V
    interleaved in one page array, cumulative query lengths) against jaxkv's XLA read of the
    same step packed its way (decodes first, then the chunk's query block)."""
    keys, values = pools
    chunk = 5  # row 0's last 5 tokens (positions 4..8), then row 2's and row 3's decodes
    q_all = jax.random.normal(jax.random.key(2), (chunk + 2, HQ, D))
    tables = _tables()
    expected = ref_ragged_paged_attention(
        q_all, _ragged_pages(keys, values), jnp.array([9, 16, 1]), jnp.asarray(tables[[0, 2, 3]]),
        jnp.array([0, chunk, chunk + 1, chunk + 2]), jnp.array([3]), sm_scale=D**-0.5,
    )  # fmt: skip
    block = 16  # jaxkv.batch.QUERY_BLOCK: the chunk padded to one query block
    q_jaxkv = jnp.zeros((2 + block, HQ, D)).at[:2].set(q_all[chunk:]).at[2 : 2 + chunk].set(q_all[:chunk])
    positions = np.full(2 + block, -1, np.int32)
    positions[:2], positions[2 : 2 + chunk] = [15, 0], np.arange(4, 9)
    rows = np.array([2, 3] + [0] * block, np.int32)
    view = PagedKVView(keys[None], values[None], 0, jnp.asarray(tables), jnp.asarray(rows), decode_tokens=2)
    out = view.attend(q_jaxkv.transpose(1, 0, 2)[None], jnp.asarray(positions)[None], scale=D**-0.5)[0]
    got = out.transpose(1, 0, 2)
    np.testing.assert_allclose(got[2 : 2 + chunk], expected[:chunk], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[:2], expected[chunk:], atol=1e-5, rtol=1e-5)


def test_decode_blocks_read_and_score_only_the_budgets_columns():
    """``decode_pages`` (a page budget): the decode blocks of a mixed step read and weigh only
    the table's first columns holding that many pages, while a prefill chunk reads the whole
    width; outputs and slot masses equal the whole-width read's (which holds nothing past them)."""
    page, num_pages = 16, 48
    keys, values = jax.random.normal(jax.random.key(3), (2, 1, num_pages, page, HKV, D))
    tables = np.full((3, table_width(512, page)), NULL_PAGE, np.int32)  # 32 columns: 4 page blocks of 8
    order = np.random.default_rng(0).permutation(np.arange(1, num_pages))
    tables[0, :8], tables[1, :5], tables[2, :30] = order[:8], order[8:13], order[13:43]
    block = 16  # jaxkv.batch.QUERY_BLOCK: row 2's chunk, positions 460..475
    positions = np.concatenate([[127, 70], np.arange(460, 460 + block)]).astype(np.int32)
    rows = np.array([0, 1] + [2] * block, np.int32)
    q = jax.random.normal(jax.random.key(4), (1, HQ, len(rows), D))
    weights = jax.random.uniform(jax.random.key(5), (1, len(rows)))

    def read(decode_pages):
        view = PagedKVView(
            keys, values, 0, jnp.asarray(tables), jnp.asarray(rows), decode_tokens=2, decode_pages=decode_pages
        )
        return view.attend(q, jnp.asarray(positions)[None], scale=D**-0.5, query_weights=weights)

    (narrow, (decodes, prefill)), (whole, (decodes_whole, prefill_whole)) = read(8), read(None)
    assert decodes.shape == (2, 8 * page, HKV) and decodes_whole.shape == (2, 32 * page, HKV)
    assert prefill.shape == (1, 32 * page, HKV)
    np.testing.assert_allclose(narrow, whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(decodes, decodes_whole[:, : 8 * page], rtol=1e-6, atol=1e-7)
    assert not np.any(decodes_whole[:, 8 * page :]) and np.all(np.asarray(decodes).sum(axis=1) > 0)
    np.testing.assert_array_equal(prefill, prefill_whole)


def test_the_kernels_layouts(pools):
    """``heads_major``: a layer's pool as ``[H_kv, P, page, D]``; ``flat_tables``: each (row, K/V head,
    slot) as its row of a flattened 'tokens' stack ``[L * P * page * H_kv, D]``, each (row, K/V head,
    page) as its tile of a flattened 'heads' stack ``[L * P * H_kv, page, D]`` (the kernels' in-place reads)."""
    keys, _ = pools
    assert heads_major(keys).shape == (HKV, PAGES, PAGE, D)
    np.testing.assert_array_equal(heads_major(keys)[1, 5, 2], keys[5, 2, 1])
    tables, places = jnp.asarray(_tables()), [(0, 0, 0), (0, 1, 8), (2, 1, 15), (3, 0, 0)]  # (row, head, slot)
    tokens = jnp.stack([keys[::-1], keys])
    rows = flat_tables(tables, 1, tokens.shape, TOKENS_LAYOUT)  # [R, H_kv, W * page]
    assert rows.shape == (len(LENGTHS), HKV, WIDTH * PAGE)
    heads = _stored(tokens.reshape(-1, PAGE, HKV, D), HEADS_LAYOUT).reshape(2, PAGES, HKV, PAGE, D)
    tiles = flat_tables(tables, 1, heads.shape, HEADS_LAYOUT)  # [R, H_kv, W]
    assert tiles.shape == (len(LENGTHS), HKV, WIDTH)
    for row, head, slot in places:
        expected = keys[_tables()[row, slot // PAGE], slot % PAGE, head]
        np.testing.assert_array_equal(tokens.reshape(-1, D)[rows[row, head, slot]], expected)
        np.testing.assert_array_equal(heads.reshape(-1, PAGE, D)[tiles[row, head, slot // PAGE], slot % PAGE], expected)


def test_xla_reads_the_heads_layout_as_the_tokens_layout(pools, queries):
    """XLA's paged read of a 'heads' pool equals its read of the same K/V in a 'tokens' pool bit
    for bit (float and int8 pages); a layer's moved slots, copied pages and page keys too."""
    q, positions = queries.transpose(1, 0, 2)[None], jnp.asarray(_positions())[None]
    int8 = QuantSpec(nbits=8, q_group_size=D, residual_length=0)
    for spec in (None, int8):
        stored = pools if spec is None else tuple(quantize(x, int8, PER_TOKEN) for x in pools)
        tokens, heads = (_view(*stored, XLA, quantization=spec, layout=layout) for layout in POOL_LAYOUTS)
        read = [view.attend(q, positions, scale=D**-0.5) for view in (tokens, heads)]
        np.testing.assert_array_equal(*read)
    positions = jnp.zeros((1, *pools[0].shape[:3]), jnp.int32)  # [L, P, page, H_kv]
    layers = [
        PagedLayer(*jax.tree.map(lambda leaf: leaf[None], tuple(_stored(p, layout) for p in pools)), layout=layout,
                   slot_positions=positions)
        for layout in POOL_LAYOUTS
    ]  # fmt: skip
    per_head = lambda slots: jnp.array(slots)[None, None, :, None]  # noqa: E731 - [L, M, K, H_kv], one row
    moved = [
        layer.with_slots_moved((per_head([5, 9]), per_head([3, 0])), (jnp.array([[2, 2]]), jnp.array([[1, 3]])), True,
                               1.0)
        .with_page_copies({"full": jnp.array([[5, 6], [12, 4]])})
        for layer in layers
    ]  # fmt: skip
    pages = jnp.array([[2, 5, 6], [4, 12, 9]])
    np.testing.assert_array_equal(moved[0].page_keys(pages), moved[1].page_keys(pages))
    assert not np.array_equal(moved[0].page_keys(pages), layers[0].page_keys(pages))


def test_the_view_dispatches_its_decodes_and_routes_the_rest(pools, queries):
    """A view under ``pallas_gpu`` reads its decode tokens with the kernel (within f32 tolerance of
    XLA, not bit for bit); with a window or int8 pages, exactly as XLA reads them (routed)."""
    q, positions = queries.transpose(1, 0, 2)[None], jnp.asarray(_positions())[None]
    int8 = QuantSpec(nbits=8, q_group_size=D, residual_length=0)

    def read(backend, **options):
        stored = pools if options.get("quantization") is None else (quantize(x, int8, PER_TOKEN) for x in pools)
        return _view(*stored, backend, **options).attend(q, positions, scale=D**-0.5)

    kernel, xla = read(PALLAS_GPU), read(XLA)
    np.testing.assert_allclose(kernel, xla, atol=1e-5, rtol=1e-5)
    assert not np.array_equal(kernel, xla)  # the kernel ran: its float32 sums differ in the last bits
    for routed in ({"window": 4}, {"quantization": int8}):
        np.testing.assert_array_equal(read(PALLAS_GPU, **routed), read(XLA, **routed))
    assert _view(*pools, PALLAS_GPU, window=4).kernel_route(D, slot_mass=False).startswith("a sliding window")


@pytest.mark.parametrize("kind, layout", [("llama", TOKENS_LAYOUT), ("gemma3", HEADS_LAYOUT)])
def test_engine_greedy_tokens_with_the_gpu_kernel(kind, layout, monkeypatch):
    """Tiny Llama and Gemma 3 through the serving engine with ``attention_backend='pallas_gpu'``
    (interpreted here), Gemma's pages stored 'heads': prefill chunks and Gemma's sliding layers
    by XLA, the full-attention layers' decodes by the kernel; the same greedy tokens as ``generate``."""
    model = Llama(LlamaConfig(**TINY_LLAMA)) if kind == "llama" else Gemma3(Gemma3Config(**TINY_GEMMA))
    traced = []
    monkeypatch.setattr(paged_layers, "paged_decode", lambda *args, **kw: traced.append(args[0]) or paged_decode(
        *args, **kw))  # fmt: skip
    prompts = [[3, 14, 15, 9, 26, 5], [35, 8, 9]]
    engine = Engine(model, kv_memory=64 * 1024, page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                    attention_backend=PALLAS_GPU, pool_layout=layout)  # fmt: skip
    assert {group.layout for group in engine.runner.cache.groups} == {layout}  # every group a PagedLayer
    assert run_arrivals(engine, prompts, [0, 1], 4) == greedy_reference(model, prompts, 4)
    assert traced and set(traced) == {PALLAS_GPU}  # traced into the decode steps


def test_serve_flags_reach_the_engine(caplog, monkeypatch):
    """``jaxkv serve --attention-backend auto --pool-layout heads`` on CPU without the native kernels:
    the engine's pools are stored 'heads' and read with XLA, said once (with them: ``cpu``)."""
    native = Engine(Llama(LlamaConfig(**TINY_LLAMA)), attention_backend="auto")
    assert native.runner.cache.groups[0].attention_backend == CPU
    monkeypatch.setattr(cpu_paged, "available", lambda: False)
    args = build_parser().parse_args(["serve", "--attention-backend", "auto", "--pool-layout", "heads", "--kv-memory",
                                      "1MiB"])  # fmt: skip
    served = resolve_serve_config(args)
    assert served.engine.attention_backend == "auto"
    with caplog.at_level(logging.INFO, logger="jaxkv.kernels.backends"):
        engine = Engine(Llama(LlamaConfig(**TINY_LLAMA)), served.engine)
    layer = engine.runner.cache.groups[0]
    assert (layer.attention_backend, layer.layout) == (XLA, HEADS_LAYOUT) and len(caplog.records) == 1
    with pytest.raises(ValueError, match="EngineConfig.attention_backend must be one of"):
        Engine(Llama(LlamaConfig(**TINY_LLAMA)), attention_backend="cudnn")
    with pytest.raises(ValueError, match="EngineConfig.pool_layout must be one of"):
        Engine(Llama(LlamaConfig(**TINY_LLAMA)), pool_layout="interleaved")
    tiers = [
        pool_formats(engine.runner.page_formats, page_size=16, quantization=None, layout=lay) for lay in POOL_LAYOUTS
    ]
    assert tiers[0]["full"]["layout"] != tiers[1]["full"]["layout"]  # a disk tier never reads the other layout


def _layout(data: int, model: int) -> Layout:
    """A mesh of the first ``data * model`` host devices (conftest sets 8)."""
    return Layout.create(make_mesh({"data": data, "model": model}, jax.devices()[: data * model]))


@pytest.mark.parametrize("layout", POOL_LAYOUTS)
def test_kernel_under_a_mesh_runs_per_device_over_its_heads(pools, queries, layout):
    """K/V heads over ``model`` (2 devices, one K/V head and its query heads each): the kernel runs
    under ``shard_map`` and agrees with the XLA read; pages split over ``data`` are refused by
    ``paged_decode`` and routed to XLA by the view, with the reason."""
    keys, values = pools
    heads = _layout(1, 2)
    tables, lengths = jnp.asarray(_tables()[TOKEN_ROWS]), jnp.asarray(np.maximum(_positions() + 1, 0))
    stacks = tuple(_stored(x, layout)[None] for x in pools)
    assert not split_pool(heads, stacks[0].shape, layout)
    got = jax.jit(lambda *a: paged_decode(PALLAS_GPU, *a, scale=D**-0.5, layout=layout, sharding=heads))(
        queries, *stacks, 0, tables, lengths)  # fmt: skip
    np.testing.assert_allclose(got, _xla(queries, keys, values), atol=1e-5, rtol=1e-5)
    pages = _layout(2, 1)
    assert split_pool(pages, stacks[0].shape, layout) and split_pool(_layout(2, 2), stacks[0].shape, layout)
    with pytest.raises(ValueError, match="splits the pool"):
        paged_decode(PALLAS_GPU, queries, *stacks, 0, tables, lengths, scale=D**-0.5, layout=layout, sharding=pages)
    view = _view(keys, values, PALLAS_GPU, layout=layout).replace(sharding=pages)
    assert view.kernel_route(D, slot_mass=False).startswith("pages split over devices")
    assert _view(keys, values, PALLAS_GPU, layout=layout).replace(sharding=heads).kernel_route(D, False) is None


@pytest.mark.filterwarnings("ignore:.*is not divisible by mesh axis:UserWarning")
@pytest.mark.parametrize("data, model", [(1, 2), (2, 4)])
def test_engine_under_a_mesh_with_the_gpu_kernel(data, model, monkeypatch):
    """Tiny Llama (8 K/V heads) served on a ``data x model`` mesh with ``pallas_gpu``: on 1x2 the
    kernel runs per device over its K/V heads (traced), on 2x4 the pages split over ``data`` send
    the decodes to XLA (not traced); either way one device's greedy tokens (``generate``)."""
    config = LlamaConfig(**TINY_LLAMA | {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8})
    traced = []
    monkeypatch.setattr(paged_layers, "paged_decode", lambda *args, **kw: traced.append(kw["sharding"]) or paged_decode(
        *args, **kw))  # fmt: skip
    prompts = [[3, 14, 15, 9, 26, 5], [35, 8, 9]]
    mesh = make_mesh({"data": data, "model": model}, jax.devices()[: data * model])
    engine = Engine(Llama(config, mesh=mesh), kv_memory=64 * 1024, page_size=4, max_num_seqs=2,
                    max_num_batched_tokens=16, attention_backend=PALLAS_GPU)  # fmt: skip
    assert engine.runner.cache.groups[0].sharding.mesh == mesh
    assert run_arrivals(engine, prompts, [0, 1], 4) == greedy_reference(Llama(config), prompts, 4)
    assert bool(traced) == (data == 1) and all(sharding.mesh == mesh for sharding in traced)


def test_dense_kernels_match_the_xla_read(queries, monkeypatch):
    """A static layer's buffer ``[B, H_kv, S, D]`` read by the Pallas GPU decode kernel (interpreted):
    ragged lengths (a padding row, a full row, a query before its row's last slot), GQA, garbage
    past each length; within 1e-5 of XLA; a prefill of 3 queries a row (padding included) by
    ``jax.nn.dot_product_attention`` (cuDNN's call, its XLA implementation here) too. What they
    lack is read by XLA, bit for bit."""
    slots, lengths = 64, jnp.array([9, 0, 64, 1], jnp.int32)
    positions = jnp.array([[8], [-1], [40], [0]], jnp.int32)  # row 2 reads slots 0..40 of its 64
    slot = jnp.arange(slots)
    keys, values = jax.random.normal(jax.random.key(3), (2, len(lengths), HKV, slots, D))
    written = slot[None, None, :, None] < lengths[:, None, None, None]
    keys, values = jnp.where(written, keys, 1e3), jnp.where(written, values, -1e3)
    mask_info = MaskInfo(jnp.where(slot[None] < lengths[:, None], slot[None], -1), slots_used=jnp.max(lengths))
    q = queries[:, :, None]  # [B, H_q, 1, D]

    def read(view_class, *more, q=q, positions=positions, **options):
        view = view_class(keys[None], values[None], 0, mask_info, *more)
        return view.attend(q, positions, scale=D**-0.5, **options)

    prefill = {"q": jnp.repeat(q, 3, axis=2), "positions": jnp.array([[6, 7, 8], [-1] * 3, [38, 39, 40], [0, -1, -1]])}
    kernel, xla = read(PositionalView, lengths, PALLAS_GPU, **prefill), read(KVView, **prefill)
    np.testing.assert_allclose(kernel, xla, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(kernel)[1] == 0)
    kernel, xla = read(PositionalView, lengths, PALLAS_GPU), read(KVView)
    np.testing.assert_allclose(kernel, xla, atol=1e-5, rtol=1e-5)
    assert not np.array_equal(kernel, xla) and np.all(np.asarray(kernel)[1] == 0)
    np.testing.assert_array_equal(read(PositionalView, lengths, PALLAS_GPU, logit_softcap=5.0),
                                  read(KVView, logit_softcap=5.0))  # fmt: skip
    plain = {"num_queries": 1, "num_slots": slots, "dtype": jnp.float32, "logit_softcap": None, "slot_mass": False}
    assert dense_route(PALLAS_GPU, **plain) is None and dense_route(PALLAS_GPU, **plain | {"num_queries": 8}) is None
    for lacking in ({"logit_softcap": 5.0}, {"slot_mass": True}, {"num_slots": 40}):
        assert dense_route(PALLAS_GPU, **(plain | lacking)), lacking
    assert dense_route(PALLAS_TPU, **plain) and dense_route(XLA, **plain) == "the xla backend"
    monkeypatch.setattr(dense_kernels, "interpreted", lambda backend: False)  # as on a GPU: cuDNN wants half floats
    assert "float32 prefill" in dense_route(PALLAS_GPU, **plain | {"num_queries": 8})
    assert dense_route(PALLAS_GPU, **plain | {"num_queries": 8, "dtype": jnp.bfloat16}) is None


def test_generate_with_each_backend(monkeypatch, caplog):
    """``generate(..., attention_backend=...)``: tiny Llama's greedy tokens are the same under every
    name; ``pallas_gpu`` traces the dense decode kernel into the loop and the prefill's attention
    into the prefill; ``auto`` on CPU is XLA, said once; a bad name is refused by name;
    ``jaxkv generate --attention-backend`` reaches the keywords."""
    model, prompts = Llama(LlamaConfig(**TINY_LLAMA)), [[3, 14, 15, 9, 26, 5], [35, 8, 9]]
    traced = []
    monkeypatch.setattr(dense_kernels, "gqa", lambda *args, **kw: traced.append("decode") or gqa(*args, **kw))
    prefill = protocol.dense_prefill
    monkeypatch.setattr(protocol, "dense_prefill", lambda *args, **kw: traced.append("prefill") or prefill(*args, **kw))
    tokens = {}
    for backend in (XLA, PALLAS_GPU, PALLAS_TPU):
        tokens[backend] = generate(model, prompts, max_new_tokens=6, attention_backend=backend).tokens.tolist()
        assert set(traced) == ({"decode", "prefill"} if backend == PALLAS_GPU else set())
        traced.clear()
    tokens[CPU] = generate(model, prompts, max_new_tokens=6, attention_backend=CPU).tokens.tolist()
    assert not traced  # the CPU kernel reads paged pools: generate's dense caches go to XLA
    monkeypatch.setattr(cpu_paged, "available", lambda: False)  # as without a compiler
    with caplog.at_level(logging.INFO, logger="jaxkv.kernels.backends"):
        tokens["auto"] = generate(model, prompts, max_new_tokens=6, attention_backend="auto").tokens.tolist()
    assert len(caplog.records) == 1 and "using xla" in caplog.records[0].getMessage() and not traced
    assert all(found == tokens[XLA] for found in tokens.values())
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        generate(model, prompts, max_new_tokens=2, attention_backend="cudnn")
    config = resolve_config(build_parser().parse_args(["generate", "--attention-backend", "pallas_gpu"]))
    assert cache_options(config)["attention_backend"] == PALLAS_GPU


@pytest.mark.filterwarnings("ignore:.*is not divisible by mesh axis:UserWarning")
def test_generate_under_a_mesh_with_the_gpu_kernels(monkeypatch):
    """Tiny Llama (8 K/V heads) on a 2x4 mesh: ``generate`` with ``pallas_gpu`` runs the dense
    kernels per device (rows over ``data``, heads over ``model``) and gives one device's tokens."""
    config = LlamaConfig(**TINY_LLAMA | {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8})
    traced = []
    for name in ("dense_prefill", "dense_decode"):
        kernel = getattr(protocol, name)
        monkeypatch.setattr(protocol, name, lambda *a, kernel=kernel, **kw: traced.append(kw["sharding"]) or kernel(
            *a, **kw))  # fmt: skip
    prompts = [[3, 14, 15, 9, 26, 5], [35, 8, 9]]
    mesh = make_mesh({"data": 2, "model": 4}, jax.devices()[:8])
    sharded = generate(Llama(config, mesh=mesh), prompts, max_new_tokens=4, attention_backend=PALLAS_GPU)
    assert len(traced) == 2 and all(layout.mesh == mesh for layout in traced)
    assert sharded.tokens.tolist() == generate(Llama(config), prompts, max_new_tokens=4).tokens.tolist()
