"""The engine's typed statistics (``jaxkv.serving.stats``) after a busy run: ``Engine.stats()`` is an
``EngineStats`` whose every field is set (the counters a run exercises counted: swaps, prefix hits
in every tier, drafts, compactions), ``/metrics`` renders every gauge from it, and the deprecated
``stats()["key"]`` still reads the old dict's values, with a ``DeprecationWarning``."""

import dataclasses
import json

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxkv.server.api import Metrics
from jaxkv.serving import Engine, EngineConfig
from jaxkv.serving.sizing import pool_sizes
from jaxkv.serving.speculation import SpeculationStats, SpeculativeConfig
from jaxkv.serving.stats import EngineStats, PoolStats, PrefixCacheStats, TierStats
from tests.cases import VOCAB

SMALL = {"page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16}
OPTIONS = {"max_tokens": 12, "ignore_eos": True}
# The counters the busy run exercises, by attribute path: each is positive after it.
COUNTED = (
    "num_steps", "num_compiled", "preemptions", "swaps", "prefix_cache.queried_tokens", "prefix_cache.hit_tokens",
    "pages.full.cached", "pages.full.usable", "pages.full.page_bytes", "peak_pages_used", "peak_kv_bytes",
    "wasted_slot_fraction", "max_concurrent_tokens", "device.capacity_bytes", "device.hit_pages", "host.pages",
    "host.bytes", "host.capacity_bytes", "host.hit_pages", "host.pages_written", "host.bytes_written",
    "host.pages_read", "host.bytes_read", "disk.pages", "disk.bytes", "disk.capacity_bytes", "disk.pages_written",
    "disk.bytes_written", "speculation.proposed", "speculation.accepted", "speculation.steps",
)  # fmt: skip
# The keys ``Engine.stats()`` returned as a dict before ``EngineStats``, in order, and each tier's.
LEGACY_KEYS = [
    "num_running", "num_waiting", "num_steps", "num_compiled", "preemptions", "swaps", "recomputes", "compactions",
    "prefix_hit_rate", "page_size", "page_bytes", "pages", "peak_pages_used", "peak_kv_bytes", "wasted_slot_fraction",
    "max_concurrent_tokens", "tiers", "speculation",
]  # fmt: skip
LEGACY_TIERS = {
    "device": ["pages", "cached_pages", "hit_pages"],
    "host": ["pages", "bytes", "pinned_bytes", "capacity_bytes", "hit_pages", "pages_in", "pages_out", "bytes_in",
             "bytes_out", "dropped_pages"],
    "disk": ["hit_pages", "pages", "bytes", "pages_written", "bytes_written", "pages_read", "bytes_read",
             "refused_files"],
}  # fmt: skip


def leaves(value, path: str = "") -> dict:
    """Every value of a statistics snapshot by its attribute path (``pages.full.used``)."""
    if dataclasses.is_dataclass(value):
        value = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in leaves(item, f"{path}.{key}").items()}
    return {path.removeprefix("."): value}


@pytest.fixture(scope="module")
def runs(llama, tmp_path_factory) -> dict[str, EngineStats]:
    """The statistics of three engines on the tiny Llama: 'busy', eight requests sharing a prefix on a
    pool of 15 pages with a host tier, a disk tier, swapping and n-gram drafts, then traffic that
    evicts the prefix and its return; 'restarted', a fresh engine on the same disk serving a
    returning prompt; 'budget', two requests under a page budget of 4 pages."""
    page_bytes = pool_sizes(llama, EngineConfig(**SMALL), 256).full_page_bytes
    options = dict(
        kv_memory=16 * page_bytes, host_kv_memory="4MiB", preemption="swap", kv_cache_dir=tmp_path_factory.mktemp("kv"),
        speculative=SpeculativeConfig(num_tokens=3, min_ngram=1, always_verify=True), **SMALL,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    shared = rng.integers(0, VOCAB, 24).tolist()
    prompts = [shared + rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(2, 16, 8)]
    busy = Engine(llama, **options)
    busy.generate_many(prompts, **OPTIONS)
    busy.generate_many([rng.integers(0, VOCAB, 40).tolist() for _ in range(2)], **OPTIONS)
    busy.generate_many(prompts[:2], **OPTIONS)
    restarted = Engine(llama, **options)
    restarted.generate_many(prompts[:1], **OPTIONS)
    budget = Engine(llama, max_pages_per_request=4, kv_memory=64 * page_bytes, **SMALL)
    budget.generate_many(prompts[:2], **OPTIONS | {"max_tokens": 24})
    return {"busy": busy.stats(), "restarted": restarted.stats(), "budget": budget.stats()}


def test_stats_are_typed_and_every_field_is_set_after_a_busy_run(runs):
    busy = runs["busy"]
    assert type(busy) is EngineStats and type(busy.prefix_cache) is PrefixCacheStats
    assert type(busy.pages["full"]) is PoolStats and type(busy.speculation) is SpeculationStats
    assert all(type(tier) is TierStats for tier in (busy.device, busy.host, busy.disk))
    values = leaves(busy)
    assert all(type(value) in (int, float) for value in values.values()), values
    assert [path for path in COUNTED if not values[path] > 0] == []
    assert busy.num_running == busy.num_waiting == busy.recomputes == busy.host.pinned_bytes == busy.device.pages == 0
    assert busy.prefix_cache.hit_rate == busy.prefix_cache.hit_tokens / busy.prefix_cache.queried_tokens
    assert busy.page_bytes == busy.pages["full"].page_bytes
    restarted = runs["restarted"].disk
    assert restarted.hit_pages == restarted.pages_read > 0 and restarted.bytes_read > 0
    assert runs["budget"].compactions > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        busy.swaps = 0


def test_metrics_render_every_gauge_from_the_stats(runs):
    stats = runs["busy"]
    metrics = Metrics()
    families = {family.name: family for family in text_string_to_metric_families(metrics.render(stats).decode())}
    value = {name: families[f"jaxkv_{name}"].samples[0].value for name in metrics.gauges}
    assert value["running_requests"] == stats.num_running and value["swaps"] == stats.swaps
    assert value["pages_free"] == stats.pages["full"].free
    assert value["prefix_cache_hit_rate"] == stats.prefix_cache.hit_rate
    assert value["host_bytes_out"] == stats.host.bytes_read > 0 and value["disk_pages"] == stats.disk.pages > 0
    assert value["speculative_acceptance_rate"] == stats.speculation.acceptance_rate > 0
    proposed = families["jaxkv_speculative_proposed_tokens"].samples[0]
    assert proposed.name == "jaxkv_speculative_proposed_tokens_total" and proposed.value == stats.speculation.proposed


def test_the_deprecated_item_access_warns_and_reads_the_old_dict(runs):
    stats = runs["busy"]
    old = stats.as_dict()
    assert list(old) == LEGACY_KEYS and {tier: list(keys) for tier, keys in old["tiers"].items()} == LEGACY_TIERS
    json.dumps(old)  # the serving benchmark's JSON rows hold it
    for key in LEGACY_KEYS:
        with pytest.warns(DeprecationWarning, match=rf"Engine.stats\(\)\['{key}'\] is deprecated"):
            assert stats[key] == old[key]
    with pytest.warns(DeprecationWarning):
        assert stats["prefix_hit_rate"] == stats.prefix_cache.hit_rate and stats["swaps"] == stats.swaps
    with pytest.warns(DeprecationWarning):
        tiers = stats["tiers"]
    assert tiers["host"]["bytes_out"] == stats.host.bytes_read
    assert tiers["disk"]["pages_written"] == stats.disk.pages_written
    assert tiers["device"]["cached_pages"] == stats.pages["full"].cached
    with pytest.warns(DeprecationWarning):
        assert stats["pages"]["full"] == {"used": 0, "free": 15, "cached": stats.pages["full"].cached, "usable": 15}
    with pytest.warns(DeprecationWarning):
        assert stats["speculation"]["acceptance_rate"] == stats.speculation.acceptance_rate
