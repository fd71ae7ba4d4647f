"""Offloaded cache layers (``jaxkv.offload``): the K/V of chosen layers lives in host memory
before and after compiled decoding, the tokens equal a resident cache's, the traced program
moves one layer per step of the layer scan, and edits (rollback, reorder, repeat, reset, a
shared prefix) give what they give on a resident cache.

On the CPU backend both memory kinds are the same RAM: these tests pin placement and the
transfers the program asks for (lowered for a GPU, where they are real copies), not speed."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import Cache
from jaxkv.cache import first_entry_shapes
from jaxkv.cli.generate import cache_options, resolve_config
from jaxkv.cli.main import build_parser
from jaxkv.decoding.beam import beam_search
from jaxkv.decoding.generate import generate, prefill_prefix
from jaxkv.decoding.speculative import SelfSpeculation, generate_speculative
from jaxkv.eviction import EvictionSpec
from jaxkv.layers.paged import Paging
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.models.qwen3_5 import Qwen3_5, Qwen3_5Config
from jaxkv.offload import DEFAULT_OFFLOAD, HOST_MEMORY, kv_leaves
from jaxkv.quantization import QuantSpec
from jaxkv.sharding import make_mesh
from tests.cases import TINY_GEMMA, TINY_LLAMA, VOCAB

LLAMA = TINY_LLAMA | {"num_hidden_layers": 4}  # one stack of 4: each scan step prefetches the next
GEMMA = TINY_GEMMA | {"num_hidden_layers": 4, "layer_types": ("sliding_attention", "full_attention") * 2}
QWEN = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=("linear_attention", "full_attention") * 2,
    max_position_embeddings=256,
)  # fmt: skip
PROMPTS = [[3, 14, 15, 9, 2, 6, 5, 3, 5], [35, 8, 9]]  # ragged
NEW_TOKENS = 6


def kinds(cache: Cache) -> tuple[set, set]:
    """Memory kinds of the K/V leaves of offloaded groups, and of every other leaf."""
    host, device = set(), set()
    for g, stack in enumerate(cache.groups):
        mask = kv_leaves(first_entry_shapes(stack).logical_axes())
        for leaf, kv in zip(jax.tree.leaves(stack), jax.tree.leaves(mask), strict=True):
            (host if kv and g in cache.offloaded else device).add(leaf.sharding.memory_kind)
    return host, device


def assert_offloaded(cache: Cache) -> None:
    assert cache.offloaded and cache.prefetched == ()
    assert kinds(cache) == ({HOST_MEMORY}, {"device"})


CASES = {
    "llama-static": (lambda: Llama(LlamaConfig(**LLAMA)), {"offload": True}),
    "llama-dynamic": (lambda: Llama(LlamaConfig(**LLAMA)), {"offload": True, "full_attention": "dynamic"}),
    "llama-quantized": (
        lambda: Llama(LlamaConfig(**LLAMA)),
        {"offload": True, "quantization": QuantSpec(nbits=4, q_group_size=8, residual_length=4)},
    ),
    "gemma3-all": (lambda: Gemma3(Gemma3Config(**GEMMA)), {"offload": "all"}),  # sliding rings too
    "qwen3_5": (lambda: Qwen3_5(Qwen3_5Config(**QWEN)), {"offload": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_the_resident_cache_and_kv_stays_on_the_host(case):
    make, options = CASES[case]
    model = make()
    settings = {key: value for key, value in options.items() if key != "offload"}
    assert_offloaded(model.init_cache(2, 32, **options))  # before
    resident = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, max_length=32, **settings)
    offloaded = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, max_length=32, **options)
    np.testing.assert_array_equal(offloaded.tokens, resident.tokens)
    assert_offloaded(offloaded.cache)  # after the compiled prefill and decode loop
    assert not resident.cache.offloaded and kinds(resident.cache)[0] == set()


def test_default_offload_is_the_full_attention_layers():
    cache = Gemma3(Gemma3Config(**GEMMA)).init_cache(1, 16, offload=True)
    assert [cache.layer_types[g] for g in cache.offloaded] == ["full_attention"]
    assert "full_attention" in DEFAULT_OFFLOAD and "sliding_attention" not in DEFAULT_OFFLOAD
    qwen = Qwen3_5(Qwen3_5Config(**QWEN)).init_cache(1, 16, offload=True)
    assert [qwen.layer_types[g] for g in qwen.offloaded] == ["full_attention"]
    # Named types and indices choose exactly; indices cover whole groups of a stacked cache.
    assert Gemma3(Gemma3Config(**GEMMA)).init_cache(1, 16, offload=[0, 2]).offloaded == (0,)
    unstacked = Cache.from_config(LlamaConfig(**LLAMA), 1, max_length=16, offload=[1, 3])
    assert unstacked.offloaded == (1, 3)


def lowered_moves(num_layers: int) -> list[tuple[str, str]]:
    """(placement, tensor type) of every transfer in a tiny Llama's decode step, lowered for a GPU."""
    model = Llama(LlamaConfig(**LLAMA | {"num_hidden_layers": num_layers}))
    graphdef, state = nnx.split(model)
    cache = model.init_cache(1, 32, offload=True)

    def step(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache)

    tokens, positions = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    text = jax.jit(step).trace(state, tokens, positions, cache).lower(lowering_platforms=("cuda",)).as_text()
    pattern = r'annotate_device_placement.*_xla_buffer_placement = "(\w+)".*: \((tensor<[^>]*>)\)'
    return re.findall(pattern, text)


def test_each_step_of_the_layer_scan_moves_one_layer_never_the_whole_cache():
    """The moves do not grow with depth (they sit in the scan's body) and each is one layer's
    K/V ``[1, B, H_kv, S, D]``: fetched (before the scan, and in each step the next layer) and
    written back (in each step the previous layer's, and the last layer's after the scan)."""
    four, eight = lowered_moves(4), lowered_moves(8)
    assert sorted(four) == sorted(eight)
    one_layer = "tensor<1x1x2x32x8xf32>"
    assert {shape for _, shape in four} == {one_layer}
    placements = [placement for placement, _ in four]
    assert placements.count("device") == 4 and placements.count(HOST_MEMORY) == 4  # 2 leaves: keys and values


def test_device_bytes_at_rest_and_in_flight():
    """At rest the device holds only what is not offloaded (row lengths). In a forward the scan
    carries two layers' K/V (the next one, fetched; the last one updated, to write back), and
    the compiled step's temporaries exceed the resident step's by less than three layers (XLA
    also copies the updated window into its carry slot), far from the whole cache (8 layers)."""
    model = Llama(LlamaConfig(**LLAMA | {"num_hidden_layers": 8}))
    graphdef, state = nnx.split(model)
    resident, offloaded = model.init_cache(1, 32), model.init_cache(1, 32, offload=True)
    layer_bytes = first_entry_shapes(resident.groups[0]).nbytes - 4  # one layer's K/V (its lengths: 4 bytes)
    (device,) = offloaded.device_bytes().values()
    (host,) = offloaded.host_bytes().values()
    assert host == 8 * layer_bytes and device == resident.nbytes - host
    assert offloaded.host_bytes().keys() == offloaded.device_bytes().keys() == {jax.devices()[0]}

    def step(state, cache):
        tokens = jnp.zeros((1, 1), jnp.int32)
        return nnx.merge(graphdef, state)(tokens, cache.next_positions(1), cache)

    def temp_bytes(cache):
        return jax.jit(step).lower(state, cache).compile().memory_analysis().temp_size_in_bytes

    carried = jax.eval_shape(lambda cache: cache.with_prefetch().prefetched, offloaded)
    windows = [leaf for leaf in jax.tree.leaves(carried) if leaf.ndim == 5]  # K/V [1, B, H_kv, S, D]
    assert sum(leaf.size * leaf.dtype.itemsize for leaf in windows) == 2 * layer_bytes
    in_flight = temp_bytes(offloaded) - temp_bytes(resident)
    assert layer_bytes < in_flight < 3 * layer_bytes, (in_flight, layer_bytes)
    _, after = jax.jit(step)(state, offloaded)
    assert_offloaded(after)
    assert after.device_bytes() == offloaded.device_bytes()


def fed_pair(stacked: bool) -> tuple[Cache, Cache]:
    """A resident and an offloaded cache of 3 full-attention layers, both fed the same tokens."""
    build = dict(batch_size=2, num_kv_heads=2, head_dim=4, max_length=16, stacked=stacked, rollback_slots=2)
    caches = [Cache.from_layer_types(["full_attention"] * 3, **build, offload=o) for o in (None, True)]
    rng = np.random.default_rng(0)
    for layer in range(3):
        k, v = (jnp.asarray(rng.normal(size=(2, 2, 5, 4)), jnp.float32) for _ in range(2))
        caches = [cache.update(layer, k, v)[0] for cache in caches]
    return caches[0], caches[1]


EDITS = {
    "rollback": lambda cache: cache.rollback(jnp.asarray([1, 3])),
    "reorder": lambda cache: cache.reorder(jnp.asarray([1, 0])),
    "select": lambda cache: cache.select(jnp.asarray([1])),
    "repeat": lambda cache: cache.repeat(2),
    "reset": lambda cache: cache.reset(),
    "grow": lambda cache: cache.grow(32),
}


@pytest.mark.parametrize("stacked", [True, False])
def test_edits_equal_the_resident_cache_and_stay_on_the_host(stacked):
    resident, offloaded = fed_pair(stacked)
    assert_offloaded(offloaded)
    for name, edit in EDITS.items():
        for run in (edit, jax.jit(edit)):
            want, got = run(resident), run(offloaded)
            assert_offloaded(got)
            for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_a_shared_prefix_seeds_continuations_unchanged():
    model = Llama(LlamaConfig(**LLAMA))
    continuations = [[7, 1], [4, 4, 2]]
    runs = {}
    for offload in (None, True):
        prefix = prefill_prefix(model, [PROMPTS[0]], max_length=32, offload=offload)
        first = generate(model, continuations, cache=prefix, max_new_tokens=4)
        again = generate(model, continuations, cache=prefix, max_new_tokens=4)
        np.testing.assert_array_equal(first.tokens, again.tokens)  # the prefix was not modified
        runs[offload] = first.tokens
        if offload:
            assert_offloaded(prefix)
            assert_offloaded(first.cache)
    np.testing.assert_array_equal(runs[True], runs[None])


def test_beam_search_and_self_speculation_equal_the_resident_cache():
    """Beams reorder within their prompt under jit; self-speculation drafts with the first layers
    (an early exit: a forward that stops mid-stack) and rolls back rejected drafts under jit."""
    model = Llama(LlamaConfig(**LLAMA))

    def run(offload):
        beams = beam_search(model, PROMPTS, max_new_tokens=4, num_beams=3, offload=offload)
        drafted = generate_speculative(
            model, PROMPTS, max_new_tokens=8, drafter=SelfSpeculation(2), num_draft_tokens=3, offload=offload
        )
        return beams.scores, drafted.tokens

    (want_scores, want_tokens), (scores, tokens) = run(None), run(True)
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)
    np.testing.assert_array_equal(tokens, want_tokens)


@pytest.mark.parametrize(
    ("offload", "error", "message"),
    [
        ("cross_attention", ValueError, r"offload names layer type 'cross_attention'.*\['full_attention'"),
        ([0, 9], ValueError, r"offload names layer 9, but this cache has layers 0\.\.3"),
        ([0, 1.5], TypeError, "offload takes True, 'all', a layer type or a list"),
        ("all", None, None),
    ],
)  # fmt: skip
def test_bad_offload_arguments_name_the_argument(offload, error, message):
    if error is None:
        assert Cache.from_config(LlamaConfig(**LLAMA), 1, max_length=8, stacked=True, offload=offload).offloaded
        return
    with pytest.raises(error, match=message):
        Cache.from_config(LlamaConfig(**LLAMA), 1, max_length=8, stacked=True, offload=offload)


def test_offload_refuses_what_it_does_not_cover():
    config = LlamaConfig(**LLAMA)
    with pytest.raises(ValueError, match=r"offload covers layers \[0, 2\] of group 0, which stacks layers"):
        Cache.from_config(config, 1, max_length=8, stacked=True, offload=[0, 2])
    sliding = LlamaConfig(**LLAMA | {"sliding_window": 4})
    with pytest.raises(ValueError, match=r"offload=True offloads the \['full_attention', 'hybrid'\] layers"):
        Cache.from_config(sliding, 1, stacked=True, offload=True)
    paging = Paging(page_size=4, num_pages=4, max_length=8)
    for settings, name in [
        ({"paging": paging}, "paging"),
        ({"eviction": EvictionSpec(policy="snapkv", budget=4)}, "eviction"),
        ({"mesh": make_mesh({"data": 1, "model": 1}, jax.devices()[:1])}, "mesh"),
    ]:
        with pytest.raises(ValueError, match=f"it does not combine with {name}"):
            Cache.from_config(config, 1, max_length=8, stacked=True, offload=True, **settings)


def test_cli_and_config_carry_offload(tmp_path):
    def resolved(*argv):
        return resolve_config(build_parser().parse_args(["generate", *argv]))

    assert resolved().cache.offload is None
    assert resolved("--offload").cache.offload is True
    assert resolved("--offload", "all").cache.offload == "all"
    assert resolved("--offload", "full_attention,2").cache.offload == ["full_attention", 2]
    config = tmp_path / "offload.yaml"
    config.write_text("cache:\n  offload: [sliding_attention, 5]\n")
    assert cache_options(resolved("--config", str(config)))["offload"] == ["sliding_attention", 5]


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_the_resident_cache():
    from jaxkv.models.load import load_pretrained

    model, tokenizer = load_pretrained("smollm2")
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "List five fruits."}]))
    resident = generate(model, [prompt], max_new_tokens=16)
    offloaded = generate(model, [prompt], max_new_tokens=16, offload=True)
    assert offloaded.row(0) == resident.row(0)
    assert_offloaded(offloaded.cache)


def test_bench_offload_smoke(tmp_path):
    """``scripts/bench_offload.py`` on a 2-layer model: offloaded and resident decode give the same
    tokens, and every bandwidth it reports (a prefetched layer, the engine's page copies) is measured."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_offload.py"
    out = tmp_path / "offload.json"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--layers", "2", "--vocab", "512",
                           "--context", "64", "--new-tokens", "4", "--repeats", "1", "--copy-pages", "4",
                           "--json", str(out)], check=False, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["same_tokens"] and report["host_bytes"] > 0
    rates = ("host_to_device_gb_per_s", "device_to_host_gb_per_s", "pages_to_host_gb_per_s", "pages_to_device_gb_per_s")
    assert all(report[key] > 0 for key in rates)
