"""``python scripts/bench_serving.py ARGS`` = ``jaxkv bench serving ARGS``: the benchmark lives in
``jaxkv.bench.serving`` (see its docstring), so an installed jaxkv runs it too."""

import sys

from jaxkv.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
