"""``jaxkv bench NAME OPTIONS``: a benchmark's own command line (``--help`` lists its options).

    jaxkv bench serving --quick
    jaxkv bench decode --systems jaxkv-static llama.cpp --weights gguf
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {"decode": "jaxkv.bench.decode", "serving": "jaxkv.bench.serving", "attention": "jaxkv.bench.attention",
              "latent": "jaxkv.bench.latent"}


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="benchmarks: decode speed (against transformers and llama.cpp), serving "
                            "(the engine against transformers and vLLM), attention kernels, latent caches")  # fmt: skip
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS))
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options (--help lists them)")


def run(args) -> int:
    """``jaxkv bench NAME OPTIONS``: the benchmark module's own command line."""
    return importlib.import_module(BENCHMARKS[args.benchmark]).main(args.options)
