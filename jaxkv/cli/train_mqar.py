"""``jaxkv train-mqar CONFIG``: train the multi-query associative recall model (``jaxkv.research.mqar``)."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxkv.config import load_config


def add_parser(sub) -> None:
    parser = sub.add_parser("train-mqar", help="train the multi-query associative recall model (jaxkv.research.mqar)")
    parser.add_argument("config", type=Path, help="YAML file (configs/mqar.yaml)")
    parser.add_argument("--output", type=Path, help="checkpoint directory (default: the config's output)")


def run(args) -> int:
    """Train, then save the checkpoint, loss curve and metrics; print where and the recall reached."""
    from jaxkv.research.mqar import MQARConfig, train  # jax, flax and optax load only for this command

    result = train(load_config(args.config, MQARConfig), args.output)
    print(f"[train-mqar] {len(result.losses)} steps in {result.seconds:.1f} s, final loss {result.losses[-1]:.4f}, "
          f"recall {result.recall:.4f} (full cache); saved to {result.output}", file=sys.stderr)  # fmt: skip
    return 0
