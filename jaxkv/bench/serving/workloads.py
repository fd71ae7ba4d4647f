"""The serving benchmark's workloads: seeded requests (prompts cut from a packaged English text, output
lengths, Poisson arrivals), the same for every system. docs/benchmarks.md describes each workload."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxkv.bench.common import TINY, TINY_CONFIG
from jaxkv.bench.vllm_worker import ServingRequest

WORKLOADS = ("random", "shared-prefix", "multi-turn", "copy-heavy", "long-generation")
BOTH = ("random", "shared-prefix")  # --workload both (multi-turn runs when named: it wants its own pool sizes)
SYSTEM_PROMPT_SPREAD = 0.05  # system prompt lengths: --system-prompt-tokens +- 5%
COPY_INSTRUCTION = "Repeat the following text exactly:\n\n"  # copy-heavy: the user's request, asked twice


@dataclasses.dataclass(frozen=True)
class WorkloadShape:
    """The distributions a workload is drawn from (docs/benchmarks.md, "Workloads")."""

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
        """The shape the command line's flags ask for."""
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
    """A workload's sizes: requests, prompt and output tokens, distinct prefix tokens, the arrivals' span."""
    prompts = [len(r.prompt) for r in requests]
    outputs = [r.max_tokens for r in requests]
    return dict(
        num_requests=len(requests), prompt_tokens=sum(prompts), output_tokens=sum(outputs),
        distinct_prefix_tokens=distinct_prefix_tokens([r.prompt for r in requests]),
        prompt_tokens_min_max=[min(prompts), max(prompts)], output_tokens_min_max=[min(outputs), max(outputs)],
        arrival_span_s=max(r.arrival for r in requests),
    )  # fmt: skip


def selected_workloads(args: argparse.Namespace) -> list[str]:
    """``--workload``'s kinds (``both``: random and shared-prefix)."""
    return list(BOTH) if args.workload == "both" else [args.workload]


def build_workloads(args: argparse.Namespace) -> dict[str, list[ServingRequest]]:
    """Each selected workload's requests, cut from ``--model``'s token source."""
    source = token_source(args.model, TINY_CONFIG["vocab_size"], args.seed)
    shape = WorkloadShape.from_args(args)
    kinds = selected_workloads(args)
    copy_prompt = copy_prompter(args.model) if "copy-heavy" in kinds else repeated
    return {kind: make_workload(kind, source, shape, args.seed, copy_prompt) for kind in kinds}
