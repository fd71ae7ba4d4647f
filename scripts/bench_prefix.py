#!/usr/bin/env python
"""Prefix reuse: time to first token with a shared 1k-token prefix prefilled once, against
prefilling the whole prompt, on SmolLM2-135M-Instruct (jaxkv, CPU by default).

    python scripts/bench_prefix.py                          # 1024-token prefix + 32-token suffixes
    python scripts/bench_prefix.py --prefix-tokens 256 --requests 2 --repeats 1   # smoke run

The prefix is a system prompt with few-shot examples (English text, tokenized, cut to
``--prefix-tokens``); each request appends its own ``--suffix-tokens`` question.

* whole prompt: a fresh static cache, then the compiled prefill of prefix + suffix (the
  exact length, no bucket padding: the fairest baseline), to the first sampled token.
* shared prefix: the prefix is prefilled once (reported, not part of any request); each
  request's compiled prefill feeds only its suffix after the prefix cache, which is read,
  not modified (``prefill_shared``: not donated, so XLA copies the buffer once per request,
  and that copy is inside the timing).

TTFT is the median of ``--repeats`` warm calls (compilation excluded and reported apart).
Both paths use the same cache capacity. Then each request generates ``--new-tokens``
greedily both ways (``generate`` with and without ``cache=``) and the tokens must be
identical. Target: TTFT >= 5x lower with the shared prefix.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


import jax
import numpy as np
from flax import nnx

from jaxkv.decoding.driver import compiled, prefill, prefill_shared
from jaxkv.decoding.generate import generate, prefill_prefix
from jaxkv.models.load import load_pretrained

TARGET_SPEEDUP = 5.0
SYSTEM = (
    "You are a careful assistant for a museum of technology. Answer in two sentences, cite the "
    "exhibit hall, and never invent dates. Examples of good answers follow.\n"
)
EXAMPLE = (
    "Q: What did the Jacquard loom contribute to computing? A: Its punched cards stored a weaving "
    "pattern that the machine read step by step, an idea later used to feed data to calculating "
    "machines (Hall B). Q: Why were vacuum tubes replaced? A: Transistors switched faster, used far "
    "less power and failed less often, so computers became smaller and more reliable (Hall D).\n"
)
QUESTIONS = [
    "Q: How does a telegraph send a message over a wire, and who used it first? A:",
    "Q: What problem did the first compilers solve for programmers of the 1950s? A:",
    "Q: Why did early hard disks spin, and what limited how much they could store? A:",
    "Q: What made the printing press spread so quickly across Europe? A:",
]


def exact(tokenizer, text: str, count: int) -> list[int]:
    """``text`` tokenized and cut (or repeated) to exactly ``count`` tokens."""
    ids = tokenizer.encode(text)
    while len(ids) < count:
        ids += ids
    return ids[:count]


def timed_prefill(fn, graphdef, state, make_cache, tokens: np.ndarray, repeats: int) -> tuple[float, float]:
    """(compile seconds, median warm seconds to the first token) of one request's prefill.

    ``make_cache()`` gives the cache each call starts from; its time counts (a fresh cache
    is part of a request's cost; a shared prefix cache is returned as is)."""
    lengths = np.asarray([tokens.shape[1]], np.int32)
    executable, compile_seconds = compiled(fn, {}, graphdef, state, make_cache(), tokens, lengths)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        first_logits, _ = executable(state, make_cache(), tokens, lengths)
        first_logits.block_until_ready()
        times.append(time.perf_counter() - start)
    return compile_seconds, statistics.median(times)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=3, help="requests sharing the prefix")
    parser.add_argument("--repeats", type=int, default=3, help="warm timed calls per request and path")
    return parser.parse_args(argv)


def time_prefix(model, prefix: list[int], capacity: int):
    """(prefix cache, seconds) of prefilling the shared prefix once, compilation included (a one-off per prefix)."""
    start = time.perf_counter()
    prefix_cache = prefill_prefix(model, [prefix], max_length=capacity)
    jax.block_until_ready(prefix_cache)
    return prefix_cache, time.perf_counter() - start


def bench_request(model, prefix: list[int], suffix: list[int], prefix_cache, capacity: int, args) -> tuple:
    """(whole TTFT, shared TTFT, whole compile, shared compile, identical tokens) of one request."""
    graphdef, state = nnx.split(model)
    whole = np.asarray([prefix + suffix], np.int32)
    compile_whole, ttft_whole = timed_prefill(
        prefill, graphdef, state, lambda: model.init_cache(1, capacity), whole, args.repeats
    )
    compile_shared, ttft_shared = timed_prefill(
        prefill_shared, graphdef, state, lambda: prefix_cache, np.asarray([suffix], np.int32), args.repeats
    )
    reference = generate(model, [prefix + suffix], max_new_tokens=args.new_tokens, max_length=capacity).row(0)
    continued = generate(model, [suffix], max_new_tokens=args.new_tokens, cache=prefix_cache).row(0)
    return ttft_whole, ttft_shared, compile_whole, compile_shared, reference == continued


def print_report(args, capacity: int, prefix_seconds: float, rows: list[tuple]) -> bool:
    """The markdown table and the target on stdout; True when the target is met."""
    print(
        f"## Prefix reuse: {args.model}, {args.prefix_tokens}-token prefix + {args.suffix_tokens}-token suffix, "
        f"capacity {capacity}, {jax.devices()[0].platform}\n"
    )
    print(f"prefix prefilled once in {prefix_seconds:.2f} s (compile included)\n")
    print(
        "| request | whole prompt TTFT s | shared prefix TTFT s | speed-up | compile s (whole / shared) | "
        f"{args.new_tokens} tokens identical |"
    )
    print("|---|---|---|---|---|---|")
    for number, whole_s, shared_s, compile_w, compile_s, same in rows:
        print(
            f"| {number} | {whole_s:.3f} | {shared_s:.3f} | {whole_s / shared_s:.1f}x | "
            f"{compile_w:.1f} / {compile_s:.1f} | {'yes' if same else 'NO'} |"
        )
    speedup = statistics.median(whole_s / shared_s for _, whole_s, shared_s, *_ in rows)
    identical = all(same for *_, same in rows)
    passed = speedup >= TARGET_SPEEDUP and identical
    print(
        f"\ntarget: TTFT >= {TARGET_SPEEDUP:g}x lower with identical output: median {speedup:.1f}x, "
        f"identical {identical} -> {'PASS' if passed else 'FAIL'}"
    )
    return passed


def main(argv=None) -> int:
    args = parse_args(argv)
    if not 1 <= args.requests <= len(QUESTIONS):
        raise SystemExit(f"--requests must be in [1, {len(QUESTIONS)}]")
    model, tokenizer = load_pretrained(args.model)
    prefix = exact(tokenizer, SYSTEM + EXAMPLE * 64, args.prefix_tokens)
    suffixes = [exact(tokenizer, question, args.suffix_tokens) for question in QUESTIONS[: args.requests]]
    capacity = 1 << (args.prefix_tokens + args.suffix_tokens + args.new_tokens - 1).bit_length()
    prefix_cache, prefix_seconds = time_prefix(model, prefix, capacity)
    rows = [
        (number, *bench_request(model, prefix, suffix, prefix_cache, capacity, args))
        for number, suffix in enumerate(suffixes)
    ]
    return 0 if print_report(args, capacity, prefix_seconds, rows) else 1


if __name__ == "__main__":
    sys.exit(main())
