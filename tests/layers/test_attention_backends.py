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
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from jaxkv.kernels import PALLAS_GPU, PALLAS_TPU, XLA, check_backend, heads_major, kernel_route, paged_decode
from jaxkv.kernels import resolve_backend
from jaxkv.layers.paged import NULL_PAGE, PagedKVView, table_width
from jaxkv.quantization import PER_TOKEN, QuantSpec, quantize

HQ, HKV, D, PAGE, PAGES = 4, 2, 16, 4, 16
WIDTH = table_width(32, PAGE)
LENGTHS = np.array([9, 0, 16, 1], np.int32)  # per row; row 1 decodes padding (position -1)
TOKEN_ROWS = np.array([2, 0, 3, 1], np.int32)  # the decode slots' rows, not in row order
TOLERANCE = {PALLAS_GPU: 1e-5, PALLAS_TPU: 3e-2}
FP8 = QuantSpec(format="e4m3", q_group_size=D, residual_length=0)


def _tables() -> np.ndarray:
    """``[R, W]``: each row's pages (distinct, out of order), the null page past them."""
    tables = np.full((len(LENGTHS), WIDTH), NULL_PAGE, np.int32)
    tables[0, :3] = [5, 2, 9]
    tables[2, :4] = [1, 12, 7, 3]
    tables[3, :1] = [15]
    return tables


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
    stack = jax.tree.map(lambda leaf: leaf[None], (keys, values))
    view = PagedKVView(
        *stack, 0, jnp.asarray(_tables()), jnp.asarray(TOKEN_ROWS), decode_tokens=len(TOKEN_ROWS), window=window,
        quantization=quantization,
    )  # fmt: skip
    q = queries.transpose(1, 0, 2)[None]  # [1, H_q, N, D]
    out = view.attend(q, jnp.asarray(_positions())[None], scale=D**-0.5, logit_softcap=logit_softcap)
    return out[0].transpose(1, 0, 2)


def _kernel(backend, queries, keys, values, quantization=None, logit_softcap=None) -> jax.Array:
    tables, lengths = _tables()[TOKEN_ROWS], np.maximum(_positions() + 1, 0)
    return paged_decode(
        backend, queries, keys, values, jnp.asarray(tables), jnp.asarray(lengths), scale=D**-0.5,
        logit_softcap=logit_softcap, quantization=quantization,
    )  # fmt: skip


@pytest.mark.parametrize(
    "backend, logit_softcap", [(PALLAS_GPU, None), (PALLAS_GPU, 5.0), (PALLAS_TPU, None)]
)  # fmt: skip
def test_kernel_matches_the_xla_paged_read(pools, queries, backend, logit_softcap):
    """Ragged lengths (a padding row included), GQA, rows' pages out of order, the null page past
    each row's pages and garbage past each length: the kernel agrees with XLA within its tolerance."""
    keys, values = pools
    expected = _xla(queries, keys, values, logit_softcap=logit_softcap)
    got = _kernel(backend, queries, keys, values, logit_softcap=logit_softcap)
    assert got.shape == (len(TOKEN_ROWS), HQ, D) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, atol=TOLERANCE[backend], rtol=TOLERANCE[backend])
    assert np.all(np.asarray(got)[TOKEN_ROWS == 1] == 0)  # the padding token sees nothing


@pytest.mark.parametrize("backend", [PALLAS_GPU, PALLAS_TPU])
def test_kernel_reads_scaled_fp8_pages(pools, queries, backend):
    """fp8 pages with one float16 scale per token and head: the kernel's scale path."""
    keys, values = (quantize(x, FP8, PER_TOKEN) for x in pools)
    assert kernel_route(backend, window=None, decode_width=1, shifted=False, slot_mass=False, quantization=FP8,
                        head_dim=D) is None  # fmt: skip
    expected = _xla(queries, keys, values, quantization=FP8)
    got = _kernel(backend, queries, keys, values, quantization=FP8)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE[backend], rtol=TOLERANCE[backend])


def test_routing_names_what_the_kernels_lack():
    """Each feature a decode kernel lacks sends the view's decode tokens to XLA, with the reason."""
    plain = dict(window=None, decode_width=1, shifted=False, slot_mass=False, quantization=None, head_dim=D)
    assert kernel_route(PALLAS_GPU, **plain) is None and kernel_route(PALLAS_TPU, **plain) is None
    lacking = {
        "window": dict(window=8), "drafts": dict(decode_width=3), "compacted": dict(shifted=True),
        "slot scores": dict(slot_mass=True), "int8": dict(quantization=QuantSpec(nbits=8, residual_length=0)),
        "fp8 groups": dict(quantization=QuantSpec(format="e4m3", q_group_size=D // 2, residual_length=0)),
    }  # fmt: skip
    for what, change in lacking.items():
        assert kernel_route(PALLAS_GPU, **(plain | change)), what
    assert kernel_route(XLA, **plain) == "the xla backend"


def test_backend_names_and_auto(caplog):
    """``auto`` picks the platform's kernel, else XLA with one log line; a bad name is refused by name."""
    assert resolve_backend("auto", "gpu") == PALLAS_GPU and resolve_backend("auto", "tpu") == PALLAS_TPU
    with caplog.at_level(logging.INFO, logger="jaxkv.kernels.backends"):
        assert resolve_backend("auto", "cpu") == XLA
    assert len(caplog.records) == 1 and "xla" in caplog.records[0].getMessage()
    assert resolve_backend(PALLAS_GPU, "cpu") == PALLAS_GPU  # explicit: interpreted off its platform
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


def test_heads_major_is_the_kernels_layout(pools):
    keys, _ = pools
    assert heads_major(keys).shape == (HKV, PAGES, PAGE, D)
    np.testing.assert_array_equal(heads_major(keys)[1, 5, 2], keys[5, 2, 1])
