"""``jaxkv experiment CONFIG...``: grids of model x task x K/V cache x budget x seed.

    jaxkv experiment configs/experiments/smoke.yaml [...] [--dry-run]
"""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    parser = sub.add_parser("experiment", help="run a grid of model x task x K/V cache x budget x seed")
    parser.add_argument(
        "config", type=Path, nargs="+",
        help="YAML grid(s), e.g. configs/experiments/smoke.yaml; several run as one, cells ordered by cache shape",
    )  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="list the cells (done or to run) and exit")
    parser.add_argument("--output-dir", type=Path, default=Path("results"), help="results go to OUTPUT_DIR/NAME/")
    parser.add_argument(
        "--compile-cache", type=Path, default=None,
        help="keep compiled programs in this directory (JAX's persistent compilation cache): a rerun, or a run of "
        "other grids with equal shapes, skips their compile",
    )  # fmt: skip


def run(args) -> int:
    """``jaxkv experiment CONFIG...``: each grid's unfinished cells, then its summary and plot
    (``jaxkv.research.experiment``, imported only for this command)."""
    from jaxkv.research.experiment import run_command

    if args.compile_cache is not None and not args.dry_run:
        # Most of a cell after a context's prefill is compiling its cache's refill and decode; the
        # grids of one command repeat those shapes (passkey and retrieval at 2k, ...).
        import jax

        jax.config.update("jax_compilation_cache_dir", str(args.compile_cache))
    return run_command(args.config, args.output_dir, dry_run=args.dry_run)
