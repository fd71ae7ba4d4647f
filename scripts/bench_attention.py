"""``python scripts/bench_attention.py ARGS`` = ``jaxkv bench attention ARGS``: decode attention,
jaxkv's XLA paged read against the Pallas kernels (see ``jaxkv.bench.attention``)."""

import sys

from jaxkv.bench.attention import main

if __name__ == "__main__":
    sys.exit(main())
