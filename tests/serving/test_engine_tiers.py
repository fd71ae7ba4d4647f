"""The engine's host page tier on tiny models, for each pool kind (full attention, sliding window,
quantized pages): evicted prefix pages come back from host memory (cached tokens reported, salts kept
apart), preempted requests swapped to host memory resume with exactly the tokens of an undisturbed run
(greedy and seeded sampling), and a full host tier falls back to recomputation.

Each test compares the engine with itself: the undisturbed runs are the same engine serving one
request at a time (no pressure), so every comparison shares one set of compiled steps."""

import jax
import numpy as np
import pytest
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig

from jaxkv.decoding.sampling import GREEDY, Sampling
from jaxkv.quantization import QuantSpec
from jaxkv.server.api import Metrics
from jaxkv.serving import Engine, EngineConfig
from jaxkv.serving.kv_manager import prefix_key
from jaxkv.serving.pages import page_hashes
from jaxkv.serving.sizing import pool_sizes
from tests.cases import TINY_GEMMA, TINY_LLAMA, VOCAB

MAX_LEN = 256
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
SMALL = {"page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16}
NEW_TOKENS = 12
FULL_PAGES = 16  # 15 usable pages of 4 tokens: one request of up to 52 tokens fits, four at once do not
CASES = {
    "full": ("llama", None),
    "sliding": ("gemma3", None),
    "quantized": ("llama", QuantSpec(nbits=8, residual_length=0, q_group_size=8)),
}


def tiny(kind: str):
    if kind == "llama":
        return Llama(LlamaConfig(**TINY_LLAMA | {"max_position_embeddings": MAX_LEN}))
    return Gemma3(Gemma3Config(**TINY_GEMMA | {"sliding_window": 8, "max_position_embeddings": MAX_LEN}))


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    kind, quantization = CASES[request.param]
    return tiny(kind), quantization


def tight_engine(model, quantization, **options) -> Engine:
    """An engine whose full-attention pool holds ``FULL_PAGES`` pages, whatever the page format."""
    probe = pool_sizes(model, EngineConfig(kv_memory="1GiB", quantization=quantization, **SMALL), MAX_LEN)
    kv_memory = probe.sliding_pages * probe.sliding_page_bytes + FULL_PAGES * probe.full_page_bytes
    return Engine(model, kv_memory=kv_memory, quantization=quantization, **SMALL, **options)


def prompts_of(seed: int, count: int, longest: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(2, longest, count)]


def run(engine: Engine, prompts, samplings) -> list[list[int]]:
    """Serve ``prompts`` together (prompt i with ``samplings[i]`` and seed 100 + i); their output tokens."""
    ids = [
        engine.add_request(prompt, sampling, max_tokens=NEW_TOKENS, ignore_eos=True, seed=100 + i)
        for i, (prompt, sampling) in enumerate(zip(prompts, samplings))
    ]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop(request_id)[0].output for request_id in ids]


def undisturbed(engine: Engine, prompts, samplings) -> list[list[int]]:
    """Each prompt served alone (it fits the pool: no preemption), with its seed of ``run``."""
    out = []
    for i, (prompt, sampling) in enumerate(zip(prompts, samplings)):
        request_id = engine.add_request(prompt, sampling, max_tokens=NEW_TOKENS, ignore_eos=True, seed=100 + i)
        while engine.has_unfinished():
            engine.step()
        out.append(engine.pop(request_id)[0].output)
    assert engine.stats().preemptions == 0
    return out


SAMPLINGS = [GREEDY, Sampling(temperature=0.9, top_k=20)] * 4


def test_swapped_requests_resume_with_the_tokens_of_an_undisturbed_run(case):
    """Eight requests on a pool that holds one or two at a time: the newest running ones are swapped to
    the host tier (every page: no prefix cache to fall back on) and swapped back; greedy and seeded
    sampled tokens equal each request served alone, and both tiers end empty."""
    model, quantization = case
    engine = tight_engine(model, quantization, host_kv_memory="4MiB", preemption="swap", prefix_caching=False)
    prompts = prompts_of(1, len(SAMPLINGS))
    alone = undisturbed(engine, prompts, SAMPLINGS)
    assert run(engine, prompts, SAMPLINGS) == alone
    stats = engine.stats()
    host = stats.host
    assert stats.swaps > 0 and stats.recomputes == 0, stats
    assert host.pages_written == host.pages_read > 0 and host.bytes_written == host.bytes_read > 0
    assert host.pages == 0 and host.pinned_bytes == 0 and stats.device.pages == 0
    engine.kv.check()


def test_swap_under_a_full_host_tier_falls_back_to_recompute():
    """A host tier without room for any request's pages: every preemption recomputes, with the same
    tokens (test_tier_ledger.py checks a tier that pinned pages fill)."""
    model = tiny("llama")
    page_bytes = pool_sizes(model, EngineConfig(**SMALL), MAX_LEN).full_page_bytes
    engine = tight_engine(model, None, host_kv_memory=page_bytes - 1, preemption="swap", prefix_caching=False)
    prompts = prompts_of(2, len(SAMPLINGS))
    alone = undisturbed(engine, prompts, SAMPLINGS)
    assert run(engine, prompts, SAMPLINGS) == alone
    stats = engine.stats()
    assert stats.swaps == 0 and stats.recomputes == stats.preemptions > 0
    assert stats.host.pages_written == 0
    engine.kv.check()


def test_evicted_prefix_pages_come_back_from_the_host_tier(case):
    """A conversation's prefix pages evicted from the device by other traffic are demoted to the host
    tier; its next turn promotes them (cached tokens reported, same tokens as computing them), after
    which they are on the device and gone from the host (one tier at a time). A request with the same
    tokens under another salt finds nothing; the salted chain comes back for its own salt. ``/metrics``
    reads the tier counters."""
    model, quantization = case
    engine = tight_engine(model, quantization, host_kv_memory="4MiB")
    rng = np.random.default_rng(3)
    shared = rng.integers(0, VOCAB, 24).tolist()  # six full pages
    turn = shared + [5, 6, 7]
    computed = engine.generate_many([turn], max_tokens=NEW_TOKENS, ignore_eos=True, cache_salt="reference")[0]
    engine.generate_many([shared + [1]], max_tokens=NEW_TOKENS, ignore_eos=True)
    floods = [rng.integers(0, VOCAB, 40).tolist() for _ in range(3)]  # 13 pages each: the device forgets
    for flood in floods:
        engine.generate_many([flood], max_tokens=NEW_TOKENS, ignore_eos=True)
    host = engine.stats().host
    assert host.pages_written > 0
    hits_before = host.hit_pages

    returned = engine.generate_many([turn], max_tokens=NEW_TOKENS, ignore_eos=True)[0]
    assert returned.num_cached_tokens == 24 and returned.token_ids == computed.token_ids
    assert engine.stats().host.hit_pages > hits_before
    full = engine.kv.pools[0]
    for page_hash in page_hashes(shared, SMALL["page_size"]):
        assert full.manager.cached(page_hash) is not None
        assert not engine.kv.tiers.host.holds(prefix_key(full.name, page_hash))

    other = engine.generate_many([turn], max_tokens=NEW_TOKENS, ignore_eos=True, cache_salt="other")[0]
    assert other.num_cached_tokens == 0 and other.token_ids == computed.token_ids
    salted = engine.generate_many([turn], max_tokens=NEW_TOKENS, ignore_eos=True, cache_salt="reference")[0]
    assert salted.num_cached_tokens == 24 and salted.token_ids == computed.token_ids
    engine.kv.check()
    rendered = Metrics().render(engine.stats()).decode()
    assert "jaxkv_host_prefix_hit_pages" in rendered and "jaxkv_host_bytes_out" in rendered


def test_warmup_compiles_the_copies_and_nothing_compiles_while_serving():
    """With a host tier, ``warmup`` also compiles the page copies of every bucket: serving a workload
    that swaps, demotes and promotes compiles nothing more."""
    engine = tight_engine(tiny("llama"), None, host_kv_memory="4MiB", preemption="swap")
    engine.warmup()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.append(event) if event == COMPILE_EVENT else None
    )
    prompts = prompts_of(6, len(SAMPLINGS))
    run(engine, prompts, SAMPLINGS)
    run(engine, prompts[::-1], SAMPLINGS)
    stats = engine.stats()
    assert stats.swaps > 0 and stats.host.pages_read > 0
    assert compiles == []


def test_host_tier_options_are_checked_and_reach_the_engine():
    from jaxkv.cli.main import build_parser
    from jaxkv.cli.serve import resolve_serve_config

    with pytest.raises(ValueError, match="host_kv_memory"):
        EngineConfig(host_kv_memory="lots")
    with pytest.raises(ValueError, match="preemption"):
        EngineConfig(preemption="sometimes")
    args = build_parser().parse_args(["serve", "--kv-memory", "64KiB", "--host-kv-memory", "1MiB"])
    config = resolve_serve_config(args)
    assert config.engine.host_kv_memory == "1MiB"
    assert Engine(tiny("llama"), config.engine).kv.tiers.host.capacity == 2**20
    assert resolve_serve_config(build_parser().parse_args(["serve"])).engine.host_kv_memory == 0
