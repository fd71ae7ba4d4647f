"""``python scripts/compaction_accuracy.py ARGS``: compressed pages' retrieval accuracy against full
K/V and ``EvictingLayer`` (``jaxkv.bench.compaction_accuracy``; see its docstring)."""

import sys

from jaxkv.bench.compaction_accuracy import main

if __name__ == "__main__":
    sys.exit(main())
