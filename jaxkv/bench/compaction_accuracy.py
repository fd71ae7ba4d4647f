"""Compressed pages' accuracy (issue 41 deliverable 6): the experiment runner's passkey or
key-value retrieval prompts answered greedily by the engine with ``max_pages_per_request`` (each
prompt whole: context and question, compacted as it is prefilled), scored as the runner scores
them (``parse_number`` of the answer equals the needle's number), beside the runner's own cells
for full K/V and for the same policy in ``EvictingLayer`` at the same budget: ``(pages - 1) *
page_size`` slots, the tokens a compaction keeps.

    .venv/bin/python scripts/compaction_accuracy.py --model smollm2 --context 2048 --pages 64 32

The runner prefills the context whole and evicts once (kvpress's protocol), then decodes the
question; the engine compacts the context chunk by chunk as it prefills, so the tokens after a
compaction attend to the compacted K/V only: equal choices of positions (``streaming_llm`` keeps
the same sinks and window either way) need not give equal answers. ``snapkv`` is the exception on
both sides: the engine prefills the whole prompt, question included, then compacts it once, and
the ``EvictingLayer`` row is ``generate`` over the same whole prompts (one prefill, evicted once by
the question's attention), as SnapKV itself runs. Prints a markdown table: per system and budget,
accuracy overall and per depth, of the same prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence

from jaxkv.cache import layer_types_of
from jaxkv.engine_args import add_engine_flags, engine_config
from jaxkv.eviction import EvictionSpec
from jaxkv.research.experiment import CacheChoice
from jaxkv.research.tasks import KVRetrievalTask, PasskeyTask, RetrievalExample, RetrievalTask, parse_number
from jaxkv.serving.compaction import COMPACTION_POLICIES, WINDOW_POLICIES, PageBudget
from jaxkv.serving.engine_config import EngineConfig

TASKS = {"passkey": PasskeyTask, "kv_retrieval": KVRetrievalTask}


def engine_texts(model, tokenizer, examples: Sequence[RetrievalExample], *, max_new_tokens: int,
                 config: EngineConfig) -> list[str]:  # fmt: skip
    """Each example's prompt (context + question) through one ``Engine(model, config)``, all
    submitted at once, greedy, stopping at the tokenizer's end of sequence: the decoded answers."""
    from jaxkv.serving import Engine

    engine = Engine(model, config)
    index = {
        engine.add_request(e.context + e.question, max_tokens=max_new_tokens, stop_token_ids=tokenizer.eos_token_ids): i
        for i, e in enumerate(examples)
    }  # fmt: skip
    tokens: list[list[int]] = [[] for _ in examples]
    while engine.has_unfinished():
        for out in engine.step():
            tokens[index[out.request_id]] += out.new_token_ids
    return [tokenizer.decode(t) for t in tokens]


def scored(examples: Sequence[RetrievalExample], texts: Sequence[str]) -> dict:
    """Accuracy overall and per requested depth of ``texts`` (one answer per example), scored as
    the runner's ``retrieval_metrics`` scores: the answer's first number equals the needle's; and
    the texts (``outputs``)."""
    correct = [parse_number(text) == e.answer for text, e in zip(texts, examples, strict=True)]
    depths = sorted({e.depth for e in examples})
    by_depth = {f"{d:g}": _share([c for c, e in zip(correct, examples) if e.depth == d]) for d in depths}
    return {"accuracy": _share(correct), "accuracy_by_depth": by_depth, "num_examples": len(examples),
            "outputs": list(texts)}  # fmt: skip


def _share(hits: list[bool]) -> float:
    return sum(hits) / len(hits)


def runner_row(task: RetrievalTask, model, tokenizer, data, context: int, seed: int, policy: str | None,
               slots: int | None) -> dict:  # fmt: skip
    """The experiment runner's cell (``task.run`` with ``CacheChoice.options``): full K/V for
    ``policy`` None, else ``EvictingLayer`` keeping ``slots`` tokens ranked by ``policy``."""
    cache = CacheChoice(name="cache", eviction=None if policy is None else {"policy": policy})
    budget = 1.0 if slots is None else slots / context
    options = cache.options(budget, context, task.prompt_length(context))
    metrics, _ = task.run(model, tokenizer, data, context, seed, options)
    return {key: metrics[key] for key in ("accuracy", "accuracy_by_depth", "num_examples", "outputs")}


def whole_prompt_texts(model, tokenizer, examples: Sequence[RetrievalExample], spec: EvictionSpec, *,
                       max_new_tokens: int, batch_size: int) -> list[str]:  # fmt: skip
    """Each example's whole prompt (context + question) through ``generate`` with an
    ``EvictingLayer`` of ``spec`` (one prefill, evicted once), greedy, ``batch_size`` rows at a time:
    the decoded answers."""
    from jaxkv.decoding.generate import generate

    texts = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        result = generate(model, [e.context + e.question for e in batch], max_new_tokens=max_new_tokens,
                          stop_tokens=tokenizer.eos_token_ids, eviction=spec)  # fmt: skip
        texts += [tokenizer.decode(result.row(i)) for i in range(len(batch))]
    return texts


def measure(args: argparse.Namespace, model, tokenizer) -> list[dict]:
    """Every row of the table: full K/V through the runner and the engine, then per budget the
    runner's ``EvictingLayer`` and the engine's compressed pages."""
    task = TASKS[args.task](kind=args.task, contexts=[args.context], depths=args.depths, examples=args.examples,
                            batch_size=args.batch_size)  # fmt: skip
    data = task.prepare(tokenizer)
    examples = task.build_examples(tokenizer, tokenizer.chat_template is not None, data.haystack, args.context,
                                   args.seed)  # fmt: skip
    base = dataclasses.replace(args.engine, max_num_seqs=args.batch_size, prefix_caching=False)

    def engine_row(pages: int | None) -> dict:
        budget = {} if pages is None else {"max_pages_per_request": pages, "compaction_policy": args.policy}
        texts = engine_texts(model, tokenizer, examples, max_new_tokens=task.max_new_tokens,
                             config=dataclasses.replace(base, **budget))  # fmt: skip
        return scored(examples, texts)

    rows = [
        dict(system="full K/V (runner)", pages=None, **runner_row(task, model, tokenizer, data, args.context, args.seed,
                                                                  None, None)),
        dict(system="full K/V (engine)", pages=None, **engine_row(None)),
    ]  # fmt: skip
    def evicting_row(slots: int) -> dict:
        if args.policy not in WINDOW_POLICIES:
            row = runner_row(task, model, tokenizer, data, args.context, args.seed, args.policy, slots)
            return dict(system=f"EvictingLayer {args.policy} (runner)", **row)
        spec = PageBudget(slots // base.page_size + 1, base.page_size, args.policy, choice="head").layer_spec(
            len(layer_types_of(model.config))
        )  # PyramidKV's: the mean budget whose first layer fills the pages
        texts = whole_prompt_texts(model, tokenizer, examples, spec, max_new_tokens=task.max_new_tokens,
                                   batch_size=args.batch_size)  # fmt: skip
        return dict(system=f"EvictingLayer {args.policy} (generate, whole prompt)", **scored(examples, texts))

    for pages in args.pages:
        slots = (pages - 1) * base.page_size
        rows += [
            dict(pages=pages, **evicting_row(slots)),
            dict(system=f"engine {args.policy}, choice per {base.compaction_choice}", pages=pages, **engine_row(pages)),
        ]
        print(f"[accuracy] {pages} pages done", flush=True)
    return rows


def markdown(rows: list[dict], page_size: int) -> str:
    """A row per system and budget: kept tokens, accuracy, accuracy per depth."""
    depths = list(rows[0]["accuracy_by_depth"])
    lines = ["| system | pages / request | tokens kept | accuracy | " + " | ".join(f"depth {d}" for d in depths) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(depths)]  # fmt: skip
    for row in rows:
        kept = "all" if row["pages"] is None else str((row["pages"] - 1) * page_size)
        by_depth = [f"{row['accuracy_by_depth'][d]:.0%}" for d in depths]
        cells = [row["system"], "-" if row["pages"] is None else str(row["pages"]), kept,
                 f"{row['accuracy']:.0%} of {row['num_examples']}", *by_depth]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a default model name, .gguf or checkpoint")
    parser.add_argument("--task", choices=list(TASKS), default="passkey")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens, answer included (the runner's)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--examples", type=int, default=3, help="prompts per depth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pages", type=int, nargs="+", default=[64, 32], help="max_pages_per_request budgets")
    parser.add_argument("--policy", choices=COMPACTION_POLICIES, default="streaming_llm")
    parser.add_argument("--batch-size", type=int, default=4, help="the runner's rows per batch; the engine's rows")
    # The engine's other settings (--page-size, --compaction-choice, --kv-memory, ...): the sweep sets its
    # rows (--batch-size), prefix caching (off), the page budget (--pages) and the policy (--policy).
    add_engine_flags(parser, skip=("seed", "max_num_seqs", "prefix_caching", "max_pages_per_request",
                                   "compaction_policy"))  # fmt: skip
    parser.set_defaults(max_num_batched_tokens=512)
    args = parser.parse_args(argv)
    if min(args.pages) < 2 or args.context < 1 or args.examples < 1:
        parser.error("--pages must be at least 2, --context and --examples positive")
    args.engine = engine_config(args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import jax.numpy as jnp

    from jaxkv.models.load import load_pretrained

    args = parse_args(argv)
    model, tokenizer = load_pretrained(args.model, dtype=jnp.float32)  # as the runner loads it (float32 default)
    start = time.perf_counter()
    rows = measure(args, model, tokenizer)
    print(f"\n## {args.task} at {args.context} tokens, {args.model}, compaction policy {args.policy}, "
          f"pages of {args.engine.page_size} ({time.perf_counter() - start:.0f} s)\n")  # fmt: skip
    print(markdown(rows, args.engine.page_size))
    return 0
