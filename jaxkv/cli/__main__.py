"""``python -m jaxkv.cli ARGS``: the ``jaxkv`` command (what ``jaxkv launch`` starts in each process)."""

import sys

from jaxkv.cli.main import main

sys.exit(main())
