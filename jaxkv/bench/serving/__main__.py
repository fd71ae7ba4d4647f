"""``python -m jaxkv.bench.serving`` = ``jaxkv bench serving`` (and, with ``--worker SPEC``, a worker)."""

import sys

from jaxkv.bench.serving.cli import main

sys.exit(main())
