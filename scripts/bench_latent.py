"""``python scripts/bench_latent.py ARGS`` = ``jaxkv bench latent ARGS``: decode attention over MLA's
latent cache and DSA against a full-head cache (see ``jaxkv.bench.latent``)."""

import sys

from jaxkv.bench.latent import main

if __name__ == "__main__":
    sys.exit(main())
