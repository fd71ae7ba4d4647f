"""Issue 42's recall on synthetic clustered keys: the share of the true top-k attention mass (k = the
budget in tokens) that a retrieval layer's chosen pages hold, for the minmax (Quest) and centroid
summaries, at several budgets (``jaxkv.research.recall``): keys in random cluster order in
sequential pages, the same keys clustered into pages by the layer at prefill (k-means), and keys
sorted by cluster in sequential pages (the best clustering could give).

    .venv/bin/python scripts/retrieval_recall.py --tokens 4096 --budgets 64 128 256 512 1024
    .venv/bin/python scripts/retrieval_recall.py --model smollm2 --tokens 4096   # a model's real keys

With ``--model``, the keys are a pretrained model's: every full-attention layer's keys after a
prefill of the first ``--tokens`` tokens of the packaged corpus, and the query of its last token
(``jaxkv.research.recall.QueryRecorder``), the recall averaged over layers and query heads.

Prints a markdown table: one row per keys, pages and summary, the mean over query heads and seeds;
then the clustering's cost (one prefill of the keys with and without it).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.layers.retrieval import RETRIEVAL_LAYERS
from jaxkv.retrieval import PAGE_ORDERS, SUMMARIES, RetrievalSpec
from jaxkv.research.recall import QueryRecorder, page_recall, recorded_heads, synthetic_keys

ROWS = (("mixed", "sequential"), ("mixed", "clustered"), ("sorted", "sequential"))  # keys, pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--clusters", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--model", help="a jaxkv.models.load name (smollm2): measure its real keys instead")
    args = parser.parse_args()
    if args.model:
        print(model_recall(args.model, args.tokens, args.budgets, args.page_size))
        return
    print(f"{args.tokens} tokens, {args.clusters} clusters, head_dim {args.head_dim}, pages of {args.page_size}, "
          f"1 sink + 1 recent page, 2 K/V heads x 2 query heads, {args.seeds} seeds")  # fmt: skip
    print("| keys | pages | summary | " + " | ".join(f"{b} tokens" for b in args.budgets) + " |")
    print("|---|---|---|" + "---:|" * len(args.budgets))
    for layout, pages in ROWS:
        draws = [
            synthetic_keys(seed, args.tokens, head_dim=args.head_dim, num_clusters=args.clusters, layout=layout)
            for seed in range(args.seeds)
        ]
        for summary in SUMMARIES:
            cells = []
            for budget in args.budgets:
                spec = RetrievalSpec(budget, args.page_size, summary=summary, pages=pages)
                cells.append(np.mean([page_recall(heads, spec).mean() for heads in draws]))
            print(f"| {layout} | {pages} | {summary} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")

    print(clustering_cost(args.tokens, args.page_size))


def model_recall(name: str, num_tokens: int, budgets: list[int], page_size: int) -> str:
    """The recall table of ``name``'s real keys: each full-attention layer's keys after a prefill of
    ``num_tokens`` corpus tokens and its last query, averaged over layers and query heads."""
    from jaxkv.decoding.generate import prefill_prefix
    from jaxkv.models.load import load_pretrained
    from jaxkv.research.corpus import corpus_text

    model, tokenizer = load_pretrained(name)
    ids = tokenizer.encode(corpus_text())[:num_tokens]
    recorder = QueryRecorder(model.config.num_attention_heads)
    start = time.perf_counter()
    layers = recorded_heads(prefill_prefix(model, [ids], max_length=num_tokens + 1, layer_builder=recorder))
    seconds = time.perf_counter() - start
    header = (
        f"{name}: {len(layers)} full-attention layers, {len(ids)} corpus tokens (prefill {seconds:.0f} s), pages of "
        f"{page_size}, 1 sink + 1 recent page, the last token's query; mean over layers and query heads"
    )
    lines = [
        header,
        "| pages | summary | " + " | ".join(f"{b} tokens" for b in budgets) + " |",
        "|---|---|" + "---:|" * len(budgets),
    ]
    for pages in PAGE_ORDERS:
        for summary in SUMMARIES:
            cells = []
            for budget in budgets:
                spec = RetrievalSpec(budget, page_size, summary=summary, pages=pages)
                cells.append(np.mean([page_recall(heads, spec).mean() for heads in layers]))
            lines.append(f"| {pages} | {summary} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


def clustering_cost(num_tokens: int, page_size: int, repeats: int = 3) -> str:
    """Seconds of one jitted prefill update of ``num_tokens`` tokens into one retrieval layer of
    SmolLM2's shape (3 K/V heads of 64), sequential against clustered pages (median of ``repeats``)."""
    keys = jax.random.normal(jax.random.key(0), (1, 3, num_tokens, 64))
    positions = jnp.arange(num_tokens, dtype=jnp.int32)[None]
    seconds = {}
    for pages in PAGE_ORDERS:
        spec = RetrievalSpec(256, page_size, pages=pages)
        layer = RETRIEVAL_LAYERS[pages].create(1, 3, 64, num_tokens, spec)
        prefill = jax.jit(lambda layer, keys: layer.update(keys, keys, positions)[0])
        jax.block_until_ready(prefill(layer, keys))  # compile
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(prefill(layer, keys))
            times.append(time.perf_counter() - start)
        seconds[pages] = float(np.median(times))
    return (
        f"one layer's prefill update of {num_tokens} tokens (3 K/V heads of 64): sequential "
        f"{seconds['sequential'] * 1e3:.1f} ms, clustered {seconds['clustered'] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
