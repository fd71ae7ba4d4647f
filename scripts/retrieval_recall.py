"""Issue 42's recall on synthetic clustered keys: the share of the true top-k attention mass (k = the
budget in tokens) that a ``RetrievalLayer``'s chosen pages hold, for the minmax (Quest) and centroid
summaries, sequential and clustered pages, at several budgets (``jaxkv.research.recall``).

    .venv/bin/python scripts/retrieval_recall.py --tokens 4096 --budgets 64 128 256 512 1024

Prints a markdown table: one row per layout and summary, the mean over query heads and seeds.
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxkv.layers.retrieval import SUMMARIES, RetrievalSpec
from jaxkv.research.recall import LAYOUTS, page_recall, synthetic_keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--clusters", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.tokens} tokens, {args.clusters} clusters, head_dim {args.head_dim}, pages of {args.page_size}, "
          f"1 sink + 1 recent page, 2 K/V heads x 2 query heads, {args.seeds} seeds")  # fmt: skip
    print("| pages | summary | " + " | ".join(f"{b} tokens" for b in args.budgets) + " |")
    print("|---|---|" + "---:|" * len(args.budgets))
    for layout in LAYOUTS:
        draws = [
            synthetic_keys(seed, args.tokens, head_dim=args.head_dim, num_clusters=args.clusters, layout=layout)
            for seed in range(args.seeds)
        ]
        for summary in SUMMARIES:
            cells = []
            for budget in args.budgets:
                spec = RetrievalSpec(budget, args.page_size, summary=summary)
                cells.append(np.mean([page_recall(heads, spec).mean() for heads in draws]))
            print(f"| {layout} | {summary} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
