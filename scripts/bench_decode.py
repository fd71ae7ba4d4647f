"""``python scripts/bench_decode.py ARGS`` = ``jaxkv bench decode ARGS``: the benchmark lives in
``jaxkv.bench.decode`` (see its docstring), so an installed jaxkv runs it too."""

import sys

from jaxkv.bench.decode import main

if __name__ == "__main__":
    sys.exit(main())
