"""Page retrieval attention (``jaxkv.layers.retrieval``).

The oracles: a budget covering the whole context gives full attention's outputs (the static
cache's, float32, at random chunk sizes, ragged rows, under jit; a tiny Llama's and Gemma 3's
logits and greedy tokens); at a small budget each query's output is softmax attention over exactly
the pages NumPy chooses here from the keys (Quest's bound or the centroid, the best over the query
heads of a K/V head, besides the sink and recent pages), whatever the chunking; a rollback and a
refill, or a reorder, give what feeding the final rows directly gives.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import Cache, SlidingWindowLayer
from jaxkv.attention import cached_attention
from jaxkv.config import CacheConfig
from jaxkv.decoding.generate import generate
from jaxkv.eviction import EvictionSpec
from jaxkv.layers.retrieval import ClusteredRetrievalLayer, RetrievalLayer
from jaxkv.retrieval import RetrievalSpec
from jaxkv.memory import storage_rows
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.models.load import load_pretrained
from jaxkv.protocol import Refill, Rollback, RowSelection, has
from jaxkv.quantization import QuantSpec
from jaxkv.research.corpus import corpus_text
from jaxkv.research.experiment import CacheChoice
from jaxkv.research.observer import Observer, refill
from tests.cases import TINY_GEMMA, TINY_LLAMA

B, H_KV, H_Q, D = 2, 2, 4, 8
GROUP = H_Q // H_KV
PAGE, CAPACITY, LENGTH = 4, 64, 40
ROW_LENGTHS = (40, 27)  # ragged: row 1 padded after 27 tokens
SMALL = {"minmax": RetrievalSpec(budget=16, page_size=PAGE), "centroid": RetrievalSpec(16, PAGE, summary="centroid")}


@jax.jit
def feed(cache, q, k, v, positions):
    return cached_attention(cache, 0, q, k, v, positions)


def layer_cache(spec: RetrievalSpec | None, batch: int = B, **options) -> Cache:
    return Cache.from_layer_types(
        ["full_attention"], batch_size=batch, num_kv_heads=H_KV, head_dim=D, max_length=CAPACITY, retrieval=spec,
        **options,
    )  # fmt: skip


@functools.cache
def inputs(seed: int = 0):
    """Queries, keys, values ``[B, H, LENGTH, D]`` and ragged positions ``[B, LENGTH]``."""
    q, k, v = (
        jax.random.normal(key, (B, heads, LENGTH, D))
        for key, heads in zip(jax.random.split(jax.random.key(seed), 3), (H_Q, H_KV, H_KV))
    )
    positions = jnp.asarray([[t if t < n else -1 for t in range(LENGTH)] for n in ROW_LENGTHS], jnp.int32)
    return q, k, v, positions


def run(spec, sizes, **options) -> tuple[np.ndarray, Cache]:
    """Every update's outputs ``[B, H_q, LENGTH, D]`` (zeros at padding), fed in chunks of ``sizes``, and
    the cache (built with ``options``)."""
    q, k, v, positions = inputs()
    cache, outs, start = layer_cache(spec, **options), [], 0
    for size in sizes:
        part = slice(start, start + size)
        cache, out = feed(cache, q[:, :, part], k[:, :, part], v[:, :, part], positions[:, part])
        outs.append(out)
        start += size
    out = np.concatenate(outs, axis=2)
    return np.where(np.asarray(positions >= 0)[:, None, :, None], out, 0.0), cache


def chunk_sizes(seed: int) -> list[int]:
    """Random chunk sizes from {1, 2, 3, 7} summing to LENGTH (few sizes: few compiles)."""
    rng, sizes = np.random.default_rng(seed), []
    while sum(sizes) < LENGTH:
        sizes.append(min(int(rng.choice([1, 2, 3, 7])), LENGTH - sum(sizes)))
    return sizes


@functools.cache
def full_outputs() -> np.ndarray:
    return run(None, [LENGTH])[0]


# --- a budget covering the context: full attention ----------------------------------------------
@pytest.mark.parametrize("seed", [1, 2])
def test_a_budget_covering_the_context_equals_full_attention(seed):
    """Random chunk sizes, ragged rows, under jit: every output equals the static cache's (float32,
    1e-5), with a budget of 48 tokens over 40 (decode steps gather pages, longer updates mask them)."""
    spec = RetrievalSpec(budget=48, page_size=PAGE, sink=1, recent=2)
    np.testing.assert_allclose(run(spec, chunk_sizes(seed))[0], full_outputs(), atol=1e-5, rtol=1e-5)


# --- a small budget: the pages NumPy chooses ------------------------------------------------------
def numpy_pages(spec: RetrievalSpec, q, k, q_pos) -> list[int]:
    """The pages a query ``q`` ``[G, D]`` (the query heads of one K/V head) at ``q_pos`` reads of keys
    ``k`` ``[S, D]`` (at least up to its page): sink, recent, and the best scored complete pages between."""
    own = q_pos // spec.page_size
    pages = set(range(spec.sink)) | set(range(max(own - spec.recent + 1, 0), own + 1))
    candidates = list(range(spec.sink, own - spec.recent + 1))
    scores = []
    for p in candidates:
        page_keys = k[p * spec.page_size : (p + 1) * spec.page_size]
        if spec.summary == "minmax":
            low, high = page_keys.min(0), page_keys.max(0)
            scores.append(max(np.maximum(g * low, g * high).sum() for g in q))
        else:
            scores.append(max(g @ page_keys.mean(0) for g in q))
    order = np.argsort(scores)[::-1][: spec.chosen_pages]
    return sorted(pages | {candidates[i] for i in order})


def numpy_retrieval(spec: RetrievalSpec, keys=None, values=None, held=None, times=range(LENGTH)) -> np.ndarray:
    """Outputs ``[B, H_q, LENGTH, D]`` of ``inputs()``'s queries (those at ``times``; zeros elsewhere)
    over the pages NumPy chooses among slots holding ``keys``/``values`` ``[B, H_kv, S, D]`` at
    positions ``held`` ``[B, H_kv, S]`` (-1: none; default: ``inputs()``'s keys, slot p holding position p)."""
    q, k, v, positions = (np.asarray(x, np.float64) for x in inputs(0))
    keys, values = (k, v) if keys is None else (np.asarray(keys, np.float64), np.asarray(values, np.float64))
    held = np.broadcast_to(np.arange(keys.shape[2]), keys.shape[:3]) if held is None else np.asarray(held)
    out = np.zeros(q.shape)
    for b, h, t in itertools.product(range(B), range(H_KV), times):
        p = int(positions[b, t])
        if p < 0:
            continue
        heads = q[b, h * GROUP : (h + 1) * GROUP, t]
        pages = numpy_pages(spec, heads, keys[b, h], p)
        slots = [s for page in pages for s in range(page * PAGE, (page + 1) * PAGE) if 0 <= held[b, h, s] <= p]
        for g in range(GROUP):
            logits = keys[b, h, slots] @ heads[g] / np.sqrt(D)
            weights = np.exp(logits - logits.max())
            out[b, h * GROUP + g, t] = weights / weights.sum() @ values[b, h, slots]
    return out


@pytest.mark.parametrize("summary", sorted(SMALL))
def test_a_small_budget_reads_the_pages_numpy_chooses_at_any_chunking(summary):
    """16 tokens (sink, own page and 2 chosen pages of 4) over 40: token by token and in random
    chunks, every output is attention over the pages NumPy chooses, and not full attention."""
    spec = SMALL[summary]
    want = numpy_retrieval(spec)
    for sizes in ([1] * LENGTH, chunk_sizes(3)):
        np.testing.assert_allclose(run(spec, sizes)[0], want, atol=1e-5, rtol=1e-5)
    assert np.max(np.abs(want - full_outputs())) > 1e-2


def test_clustered_pages_keep_positions_with_keys_and_queries_read_the_pages_numpy_chooses():
    """A prefill of 24 tokens (one update) attends over sequential pages, then its pages 1-5 are
    reordered by cluster per K/V head, each key keeping its position. Each of the 16 decode steps
    after it reads the pages NumPy chooses from the layout it leaves: a page leaving the recent
    page is folded into the clusters before the step's query reads (row 0's pages 6-8; ragged row
    1, past its 27 tokens, moves none): its tokens join their nearest centroids and the slots are
    laid out cluster by cluster, in position order within one. No rollback; a refill gets the
    tokens in order."""
    spec = RetrievalSpec(16, PAGE, pages="clustered")
    q, k, v, positions = inputs()
    k_np, v_np = np.asarray(k), np.asarray(v)
    cache, out = feed(layer_cache(spec), q[:, :, :24], k[:, :, :24], v[:, :, :24], positions[:, :24])
    live = np.asarray(positions >= 0)[:, None, :, None]
    np.testing.assert_allclose(np.where(live[:, :, :24], out, 0), numpy_retrieval(spec, times=range(24))[:, :, :24],
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    for t in range(24, LENGTH):
        cache, out = feed(cache, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], positions[:, t : t + 1])
        held = np.asarray(cache.groups[0].held_positions(0))  # [B, H_kv, S]: what the step read, its fold done
        at = np.minimum(held, LENGTH - 1)[..., None]
        keys, values = np.take_along_axis(k_np, at, axis=2), np.take_along_axis(v_np, at, axis=2)
        want = numpy_retrieval(spec, keys, values, held, times=[t])[:, :, t : t + 1]
        np.testing.assert_allclose(np.where(live[:, :, t : t + 1], out, 0), want, atol=1e-5, rtol=1e-5)
    stack = cache.groups[0]
    keys, held, clusters, centroids = (
        np.asarray(x) for x in (stack.keys[0], stack.kv_positions(0), stack.slot_clusters[0], stack.centroids[0])
    )
    np.testing.assert_array_equal(np.asarray(stack.clustered[0]), [40, 24])
    for b, h in np.ndindex(B, H_KV):
        length, cut = ROW_LENGTHS[b], (40, 24)[b]
        assert sorted(held[b, h, :length]) == list(range(length))  # positions travel with their keys
        np.testing.assert_array_equal(keys[b, h, :length], k_np[b, h, held[b, h, :length]])
        np.testing.assert_array_equal(held[b, h, cut:length], range(cut, length))  # the recent page, in order
        region = list(zip(clusters[b, h, PAGE:cut], held[b, h, PAGE:cut]))
        assert region == sorted(region)  # cluster by cluster, position order within one
        folded = held[b, h, PAGE:cut] >= 24  # decode tokens folded in: each in its nearest cluster
        distance = ((keys[b, h, PAGE:cut, None] - centroids[b, h][None]) ** 2).sum(-1)
        np.testing.assert_array_equal(clusters[b, h, PAGE:cut][folded], distance.argmin(-1)[folded])
    assert any(not np.array_equal(held[0, h, 24:36], range(24, 36)) for h in range(H_KV))  # folded among the prefill's
    with pytest.raises(ValueError, match=r"ClusteredRetrievalLayer cannot roll back .* pages='sequential'"):
        cache.rollback(1)
    static = jax.jit(refill)(cache, layer_cache(None)).layer(0)
    for b, length in enumerate(ROW_LENGTHS):
        np.testing.assert_array_equal(static.keys[b, :, :length], k_np[b, :, :length])


def test_a_dense_prefill_reads_every_token_and_decode_steps_retrieve():
    """``prefill='dense'`` (Quest's): an update of 24 tokens attends like the full cache; the decode
    steps after it read the pages NumPy chooses, as with a retrieving prefill."""
    spec = RetrievalSpec(16, PAGE, prefill="dense")
    out, _ = run(spec, [24] + [1] * 16)
    np.testing.assert_allclose(out[:, :, :24], full_outputs()[:, :, :24], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out[:, :, 24:], numpy_retrieval(spec)[:, :, 24:], atol=1e-5, rtol=1e-5)


@jax.jit
def feed_layer(cache, layer, q, k, v, positions):
    return cached_attention(cache, layer, q, k, v, positions)


def test_dense_layers_read_every_token_and_the_others_retrieve():
    """``dense_layers=2`` over 3 stacked layers: entries 0 and 1 are dense (stacked or not), and under a
    traced layer index (a model's scan) layer 0 attends like the full cache and layer 2 reads the pages
    NumPy chooses, in random chunks."""
    spec = RetrievalSpec(16, PAGE, dense_layers=2)
    options = {"batch_size": B, "num_kv_heads": H_KV, "head_dim": D, "max_length": CAPACITY, "retrieval": spec}
    for stacked in (False, True):  # the stacked cache is read below
        cache = Cache.from_layer_types(["full_attention"] * 3, stacked=stacked, **options)
        assert [bool(layer.dense.all()) for layer in cache.layers] == [True, True, False]
    q, k, v, positions = inputs()
    outs, start = {0: [], 2: []}, 0
    for size in chunk_sizes(3):
        part = slice(start, start + size)
        for layer in outs:
            cache, out = feed_layer(
                cache, jnp.int32(layer), q[:, :, part], k[:, :, part], v[:, :, part], positions[:, part]
            )
            outs[layer].append(out)
        start += size
    padding = np.asarray(positions >= 0)[:, None, :, None]
    dense, retrieved = (np.where(padding, np.concatenate(outs[layer], axis=2), 0.0) for layer in (0, 2))
    np.testing.assert_allclose(dense, full_outputs(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(retrieved, numpy_retrieval(spec), atol=1e-5, rtol=1e-5)


def test_rollback_then_refill_equals_feeding_the_final_rows():
    """Undo 6 tokens (a page and a half) of 30 and feed 10 others: the last update's outputs equal
    a cache fed the final tokens directly, at a small budget (the refilled pages are summarized again)."""
    spec = SMALL["minmax"]
    q, k, v, _ = inputs(0)
    q2, k2, v2, _ = inputs(1)
    positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (B, LENGTH))
    rolled, _ = feed(layer_cache(spec), q[:, :, :30], k[:, :, :30], v[:, :, :30], positions[:, :30])
    rolled = rolled.rollback(6)
    assert rolled.lengths.tolist() == [24, 24] and has(rolled.groups[0], Rollback)
    direct, _ = feed(layer_cache(spec), q[:, :, :24], k[:, :, :24], v[:, :, :24], positions[:, :24])
    tail = (q2[:, :, 24:34], k2[:, :, 24:34], v2[:, :, 24:34], positions[:, 24:34])
    np.testing.assert_allclose(feed(rolled, *tail)[1], feed(direct, *tail)[1], atol=1e-6)


def test_reorder_moves_rows_with_their_pages():
    """After ``reorder([1, 0])`` the next update's outputs are the unreordered cache's, rows swapped."""
    spec = SMALL["centroid"]
    q, k, v, _ = inputs(0)
    positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (B, LENGTH))
    cache, _ = feed(layer_cache(spec), q[:, :, :32], k[:, :, :32], v[:, :, :32], positions[:, :32])
    step = (q[:, :, 32:33], k[:, :, 32:33], v[:, :, 32:33], positions[:, 32:33])
    swapped = tuple(x[::-1] for x in step)
    np.testing.assert_array_equal(feed(cache.reorder(jnp.asarray([1, 0])), *swapped)[1], feed(cache, *step)[1][::-1])
    assert has(cache.groups[0], RowSelection) and has(cache.groups[0], Refill)


def test_a_refill_from_an_observed_prefill_equals_feeding_the_tokens():
    """``refill`` (the experiment runner's one prefill per context) stores the observer's tokens and
    summarizes their pages as feeding them does: every leaf equal."""
    spec = SMALL["minmax"]
    q, k, v, positions = inputs(0)
    observed = Cache.from_layer_types(
        ["full_attention"], batch_size=B, num_kv_heads=H_KV, head_dim=D, max_length=CAPACITY, layer_builder=Observer()
    )
    observed, _ = feed(observed, q, k, v, positions)
    direct, _ = feed(layer_cache(spec), q, k, v, positions)
    jax.tree.map(np.testing.assert_array_equal, jax.jit(refill)(observed, layer_cache(spec)), direct)


# --- host memory (offload) ----------------------------------------------------------------------
HOST_SPECS = {
    "sequential minmax": SMALL["minmax"],
    "sequential, dense prefill": RetrievalSpec(16, PAGE, prefill="dense"),
    "clustered centroid": RetrievalSpec(16, PAGE, summary="centroid", pages="clustered"),
}


def memory_kinds(layer) -> dict[str, str]:
    return {field: getattr(layer, field).sharding.memory_kind for field in ("keys", "values", "summaries", "lengths")}


@pytest.mark.parametrize("name", sorted(HOST_SPECS))
def test_host_memory_pages_equal_device_pages(name):
    """``offload=True``: keys and values live in host memory (``pinned_host``), the summaries and
    lengths on the device, before and after updates in random chunks (ragged rows, under jit:
    decode steps gather their pages there, longer updates read the entry on the device; clustered
    pages are reordered and folded through the device); every output and every leaf equals the
    device cache's."""
    spec = HOST_SPECS[name]
    sizes = chunk_sizes(4)
    host = {"keys": "pinned_host", "values": "pinned_host", "summaries": "device", "lengths": "device"}
    assert memory_kinds(layer_cache(spec, offload=True).groups[0]) == host
    (want, device), (got, offloaded) = run(spec, sizes), run(spec, sizes, offload=True)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    assert memory_kinds(offloaded.groups[0]) == host and offloaded.offloaded == (0,)
    for got_leaf, want_leaf in zip(
        jax.tree.leaves(offloaded.groups[0]), jax.tree.leaves(device.groups[0]), strict=True
    ):
        np.testing.assert_allclose(got_leaf, want_leaf, atol=1e-6)


def test_host_memory_pages_roll_back_reorder_and_refill():
    """A rollback, a reorder and a refill of a host-memory cache give the device cache's leaves,
    and keep the keys and values in host memory."""
    spec = SMALL["minmax"]
    q, k, v, positions = inputs(0)
    filled = {}
    for offload in (None, True):
        cache, _ = feed(layer_cache(spec, offload=offload), q[:, :, :30], k[:, :, :30], v[:, :, :30], positions[:, :30])
        filled[offload] = cache.rollback(6).reorder(jnp.asarray([1, 0]))
    observed = Cache.from_layer_types(
        ["full_attention"], batch_size=B, num_kv_heads=H_KV, head_dim=D, max_length=CAPACITY, layer_builder=Observer()
    )
    observed, _ = feed(observed, q, k, v, positions)
    refilled = {offload: refill(observed, layer_cache(spec, offload=offload)) for offload in (None, True)}
    for results in (filled, refilled):
        assert memory_kinds(results[True].groups[0])["keys"] == "pinned_host"
        for got, want in zip(jax.tree.leaves(results[True].groups[0]), jax.tree.leaves(results[None].groups[0])):
            np.testing.assert_array_equal(got, want)


def test_a_host_memory_decode_step_copies_no_whole_stack():
    """The compiled decode step of host-memory layers, a scan over 3 stacked layers with the cache
    donated (as a model's forward in ``generate``'s loop): the stacks of keys and values
    ``[3, 1, H_kv, S, D]`` (one row: layouts that differ only in a unit axis would be copied) appear
    only as the loop's parameters and carry and the in-place scatter
    of the new token, never copied, nor sliced whole to the device (the offload of a plain layer
    fetches each layer's entry); the pages are gathered in host memory."""
    layers = 3
    cache = Cache.from_layer_types(
        ["full_attention"] * layers, batch_size=1, num_kv_heads=H_KV, head_dim=D, max_length=CAPACITY,
        retrieval=SMALL["minmax"], stacked=True, offload=True,
    )  # fmt: skip
    q, k, v, positions = (x[:1] for x in inputs(0))
    for layer in range(layers):
        cache, _ = cache.update(layer, k[:, :, :30], v[:, :, :30], positions[:, :30])

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, update):
        def layer(cache, index):
            return cached_attention(cache, index, *update)

        return jax.lax.scan(layer, cache, jnp.arange(layers))

    text = step.lower(cache, (q[:, :, 30:31], k[:, :, 30:31], v[:, :, 30:31], positions[:, 30:31])).compile().as_text()
    whole = [line.strip() for line in text.splitlines() if f"= f32[{layers},1,{H_KV},{CAPACITY},{D}]" in line]
    assert any("scatter" in line for line in whole), whole
    assert not [line for line in whole if " copy(" in line or "dynamic-slice" in line or "copy-start" in line], whole
    assert '_xla_compute_type="host"' in text


# --- models -------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def forward(graphdef, state, tokens, positions, cache):
    return nnx.merge(graphdef, state)(tokens, positions, cache)


def prefill_logits(model, cache, tokens: np.ndarray, sizes: list[int]) -> np.ndarray:
    graphdef, state = nnx.split(model)
    logits, start = [], 0
    for size in sizes:
        part = jnp.asarray(tokens[:, start : start + size])
        out, cache = forward(graphdef, state, part, cache.next_positions(size), cache)
        logits.append(out)
        start += size
    return np.concatenate(logits, axis=1)


@pytest.mark.parametrize(
    "family, pages, dense_layers", [("llama", "sequential", 0), ("llama", "sequential", 2), ("gemma3", "clustered", 0)]
)
def test_models_at_a_budget_covering_the_context_equal_the_full_cache(family, pages, dense_layers):
    """A tiny Llama (its first 2 of 3 layers dense, or none) and Gemma 3 (global layers retrieve from
    clustered pages, sliding rings unchanged): logits fed in chunks of 5 and 1 equal the full cache's
    (float32, 1e-4), and greedy tokens are equal."""
    if family == "llama":
        model = Llama(LlamaConfig(**TINY_LLAMA), seed=0)
    else:
        model = Gemma3(Gemma3Config(**TINY_GEMMA), seed=0)
    spec = RetrievalSpec(budget=32, page_size=PAGE, pages=pages, dense_layers=dense_layers)
    cache = model.init_cache(1, 32, retrieval=spec)
    assert {type(layer) for layer in cache.layers} == (
        {RetrievalLayer} if family == "llama" else {ClusteredRetrievalLayer, SlidingWindowLayer}
    )
    tokens = np.random.default_rng(0).integers(1, TINY_LLAMA["vocab_size"], size=(1, 20))
    sizes = [5, 5, 1, 1, 5, 1, 1, 1]
    want = prefill_logits(model, model.init_cache(1, 32), tokens, sizes)
    np.testing.assert_allclose(prefill_logits(model, cache, tokens, sizes), want, atol=1e-4, rtol=1e-4)
    prompts = [tokens[0, :13].tolist(), tokens[0, :6].tolist()]
    greedy = generate(model, prompts, max_new_tokens=8).tokens
    np.testing.assert_array_equal(
        generate(model, prompts, max_new_tokens=8, max_length=32, retrieval=spec).tokens, greedy
    )


@pytest.mark.parametrize("family, pages", [("llama", "sequential"), ("gemma3", "clustered")])
def test_models_retrieve_from_host_memory_as_from_the_device(family, pages):
    """``offload=True`` with retrieval in ``generate``: a tiny Llama and Gemma 3 (its global layers'
    K/V in host memory, the sliding rings on the device) at a budget of 8 tokens over prompts of 13
    and 6 draw the tokens the device cache draws."""
    model = (
        Llama(LlamaConfig(**TINY_LLAMA), seed=0) if family == "llama" else Gemma3(Gemma3Config(**TINY_GEMMA), seed=0)
    )
    spec = RetrievalSpec(budget=8, page_size=PAGE, pages=pages)
    tokens = np.random.default_rng(1).integers(1, TINY_LLAMA["vocab_size"], size=13)
    prompts = [tokens.tolist(), tokens[:6].tolist()]
    options = dict(max_new_tokens=12, max_length=32, retrieval=spec)
    device, host = generate(model, prompts, **options), generate(model, prompts, **options, offload=True)
    np.testing.assert_array_equal(host.tokens, device.tokens)
    global_group = len(host.cache.groups) - 1  # Llama: its one group; Gemma 3: the global layers'
    assert host.cache.offloaded == (global_group,)
    assert memory_kinds(host.cache.groups[global_group])["keys"] == "pinned_host"
    assert not np.array_equal(device.tokens, generate(model, prompts, max_new_tokens=12).tokens)


# --- configuration and errors --------------------------------------------------------------------
def test_config_paths_build_the_layer_and_its_bytes_follow_the_formula():
    """``cache.retrieval`` (the generate config) and an experiment's cache build a ``RetrievalLayer``
    whose bytes are the formula's; its storage row is registered."""
    spec = CacheConfig.model_validate(
        {"retrieval": {"budget": 32, "page_size": 8, "summary": "centroid"}}
    ).retrieval
    assert spec == RetrievalSpec(32, 8, summary="centroid")
    choice = CacheChoice.model_validate({"name": "quest", "retrieval": {"budget": 32, "page_size": 8}})
    assert choice.kind == "retrieval" and choice.options(1.0, 64) == {"retrieval": RetrievalSpec(32, 8)}
    assert "retrieval" not in CacheChoice(name="full").settings()
    layer = Cache.from_layer_types(
        ["full_attention"], batch_size=2, num_kv_heads=H_KV, head_dim=D, max_length=61, retrieval=spec
    ).layer(0)
    assert layer.capacity == 64 and layer.describe() == "budget=32 page=8 centroid"
    assert layer.nbytes == RetrievalLayer.kv_bytes(2, 61, H_KV, D, jnp.float32, spec=spec)
    assert ("full_attention", "retrieved", RetrievalLayer) in storage_rows()
    clustered = RetrievalSpec(32, 8, pages="clustered")
    assert (
        CacheConfig.model_validate({"retrieval": {"budget": 32, "page_size": 8, "pages": "clustered"}}).retrieval
        == clustered
    )
    layer = Cache.from_layer_types(
        ["full_attention"], batch_size=2, num_kv_heads=H_KV, head_dim=D, max_length=61, retrieval=clustered
    ).layer(0)
    assert layer.describe() == "budget=32 page=8 minmax clustered"
    assert layer.nbytes == ClusteredRetrievalLayer.kv_bytes(2, 61, H_KV, D, jnp.float32, spec=clustered)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget": 30, "page_size": 8}, "budget must be a positive multiple of page_size 8"),
        ({"budget": 16, "page_size": 0}, "page_size must be at least 1"),
        ({"budget": 16, "recent": 0}, "recent must be at least 1 page"),
        ({"budget": 16, "sink": -1}, "sink must be >= 0"),
        ({"budget": 16, "summary": "mean"}, "summary must be one of"),
        ({"budget": 16, "pages": "kmeans"}, "pages must be one of"),
        ({"budget": 16, "prefill": "full"}, "prefill must be one of"),
        ({"budget": 16, "dense_layers": -1}, "dense_layers must be >= 0"),
        ({"budget": 16, "page_size": 8, "sink": 2}, "2 sink \\+ 1 recent pages are always read but the budget is 2"),
    ],
)
def test_spec_errors_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RetrievalSpec(**kwargs)


def test_build_errors_name_the_fix():
    spec = RetrievalSpec(16, PAGE)
    options = {"batch_size": 1, "num_kv_heads": 1, "head_dim": D, "retrieval": spec}
    with pytest.raises(ValueError, match="pass max_length, full_attention='static' and no quantization"):
        Cache.from_layer_types(["full_attention"], max_length=8, quantization=QuantSpec(nbits=8), **options)
    with pytest.raises(ValueError, match="and no eviction"):
        Cache.from_layer_types(["full_attention"], max_length=8, eviction=EvictionSpec("h2o", budget=4), **options)
    with pytest.raises(ValueError, match="pass max_length"):
        Cache.from_layer_types(["full_attention"], full_attention="dynamic", **options)
    with pytest.raises(ValueError, match="dense_layers must be below the model's 2 layers"):
        dense = dataclasses.replace(spec, dense_layers=2)
        Cache.from_layer_types(["full_attention"] * 2, max_length=8, **(options | {"retrieval": dense}))
    with pytest.raises(ValueError, match="a hybrid layer .* reads all"):
        linear = {"conv_width": 2, "conv_channels": 4, "state_shapes": ((2, 2),)}
        Cache.from_layer_types(["hybrid"], max_length=8, **linear, **options)


def greedy(model, cache, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The logits ``[1, T + steps, V]`` of ``prompt`` ``[1, T]`` (one update) and of ``steps`` greedy
    tokens fed one at a time, and those tokens ``[steps]``."""
    graphdef, state = nnx.split(model)
    logits, cache = forward(graphdef, state, jnp.asarray(prompt), cache.next_positions(prompt.shape[1]), cache)
    outs, tokens = [logits], []
    for _ in range(steps):
        tokens.append(int(jnp.argmax(outs[-1][0, -1])))
        out, cache = forward(graphdef, state, jnp.asarray([[tokens[-1]]]), cache.next_positions(1), cache)
        outs.append(out)
    return np.concatenate(outs, axis=1), np.asarray(tokens)


def test_smollm2_at_a_budget_covering_the_context_equals_the_full_cache():
    """SmolLM2-135M (float32; clustered pages, centroid summaries): 16 corpus tokens in one update,
    then 6 greedy decode steps (the fourth fills a page that is folded into the clusters): the
    greedy tokens equal the full cache's and every logit is within 1e-4."""
    model, tokenizer = load_pretrained("smollm2")
    prompt = np.asarray([tokenizer.encode(corpus_text(), add_special_tokens=False)[:16]])
    spec = RetrievalSpec(budget=32, page_size=PAGE, summary="centroid", pages="clustered")
    logits, tokens = greedy(model, model.init_cache(1, 32, retrieval=spec), prompt, 6)
    want_logits, want_tokens = greedy(model, model.init_cache(1, 32), prompt, 6)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=1e-4)
