"""The systems the serving benchmark runs, the groups they fall in, and their names in tables and charts."""

from __future__ import annotations

import argparse
import dataclasses

from jaxkv.serving.engine_config import EngineConfig
from jaxkv.serving.speculation import SpeculativeConfig

SYSTEMS = {
    "engine": "jaxkv engine",
    "engine-no-prefix": "jaxkv engine, no prefix cache",
    "static": "jaxkv static batches",
    "hf": "transformers CB (CPU)",
    "vllm": "vLLM (its defaults)",
    "vllm-matched": "vLLM (jaxkv's settings)",
    "engine-host-tier": "jaxkv engine + host page tier",
    "engine-disk-tier": "jaxkv engine + host and disk tiers, restarted",
    "engine-ngram": "jaxkv engine + n-gram speculation",
    "engine-draft": "jaxkv engine + draft-model speculation",
}
COMPACT_PREFIX = "engine-compact-"  # engine-compact-<pages>: the engine, at most <pages> pages per request
# Not run unless named: speculative decoding in the engine, by its method.
SPECULATIVE_SYSTEMS = {"engine-ngram": "ngram", "engine-draft": "draft"}
ENGINE_SYSTEMS = ("engine", "engine-no-prefix", "engine-host-tier", "engine-disk-tier", *SPECULATIVE_SYSTEMS)
TIER_SYSTEMS = ("engine-host-tier", "engine-disk-tier")  # not run unless named: the memory tiers, for multi-turn
VLLM_SYSTEMS = ("vllm", "vllm-matched")  # not run unless named: the first use installs vLLM (~5 min)
GPU_SYSTEMS = ("engine", "engine-no-prefix", "static")  # --device gpu: jaxkv's systems, JAX on the GPU
ON_GPU = (*GPU_SYSTEMS, *SPECULATIVE_SYSTEMS)  # what --device gpu runs there when named
NAMED_ONLY = (*VLLM_SYSTEMS, *TIER_SYSTEMS, *SPECULATIVE_SYSTEMS)
DEFAULT_HOST_TIER = "4GiB"  # the tier systems' host tier when the engine flags set none


def system_engine(base: EngineConfig, system: str, speculation: dict, model: str) -> EngineConfig:
    """The engine an engine system runs: ``base`` (the engine flags) with what the system varies:
    prefix caching off for ``engine-no-prefix``; a host tier (``base``'s, else ``DEFAULT_HOST_TIER``)
    for the tier systems, none for the others; the page budget of ``engine-compact-<pages>``; the
    speculation of ``engine-ngram`` / ``engine-draft`` (``speculation``: the ``--speculative-*``
    flags; 'draft' drafts with their ``draft_model``, else with ``model`` itself)."""
    host = (base.host_kv_memory or DEFAULT_HOST_TIER) if system in TIER_SYSTEMS else 0
    changes = dict(host_kv_memory=host, prefix_caching=base.prefix_caching and system != "engine-no-prefix",
                   speculative=_speculation(system, speculation, model))  # fmt: skip
    if compaction_pages(system) is not None:
        changes["max_pages_per_request"] = compaction_pages(system)
    return dataclasses.replace(base, **changes)


def _speculation(system: str, flags: dict, model: str) -> SpeculativeConfig | None:
    method = SPECULATIVE_SYSTEMS.get(system)
    if method is None:
        return None
    draft = flags.get("draft_model") or model if method == "draft" else None
    return SpeculativeConfig(**flags | {"method": method, "draft_model": draft})


def default_systems(device: str) -> list[str]:
    """``--systems``' default: on the GPU jaxkv's, on the CPU all but those run only when named."""
    return list(GPU_SYSTEMS) if device == "gpu" else [s for s in SYSTEMS if s not in NAMED_ONLY]


def compaction_pages(system: str) -> int | None:
    """The page budget of an ``engine-compact-<pages>`` system; None for any other system."""
    return int(system.removeprefix(COMPACT_PREFIX)) if system.startswith(COMPACT_PREFIX) else None


def base_system(system: str) -> str:
    """The system ``system`` runs as: ``engine`` for ``engine-compact-<pages>``, else itself."""
    return "engine" if system.startswith(COMPACT_PREFIX) else system


def system_title(system: str) -> str:
    """A system's name in tables and charts."""
    pages = compaction_pages(system)
    return SYSTEMS[system] if pages is None else f"jaxkv engine, <= {pages} pages / request"


def system_color(system: str) -> str:
    """A system's matplotlib colour: each of ``SYSTEMS`` its own, the compressed engines after them."""
    pages = compaction_pages(system)
    return f"C{list(SYSTEMS).index(system) if pages is None else len(SYSTEMS) + pages.bit_length()}"


def system_name(text: str) -> str:
    """``--systems``' argument: a name of ``SYSTEMS`` or ``engine-compact-<pages>``, pages >= 2."""
    pages = text.removeprefix(COMPACT_PREFIX)
    if text in SYSTEMS or (text.startswith(COMPACT_PREFIX) and pages.isdigit() and int(pages) >= 2):
        return text
    raise argparse.ArgumentTypeError(
        f"invalid system {text!r}: choose from {', '.join(SYSTEMS)} or {COMPACT_PREFIX}<pages> (pages >= 2)"
    )


def workload_label(workload: str, concurrency: int | None) -> str:
    """A workload's name in tables and targets, with its concurrency cap if it had one."""
    return workload + ("" if concurrency is None else f", concurrency {concurrency}")
