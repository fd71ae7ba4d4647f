"""``jaxkv``: the command line. Each subcommand is a module of this package with ``add_parser``
and ``run``; this module only builds the parser and dispatches.

    jaxkv generate --model smollm2 --prompt "What is a KV cache?"   (jaxkv.cli.generate)
    jaxkv chat --system "Be brief."                                 (jaxkv.cli.chat)
    jaxkv serve --config configs/serve.yaml                         (jaxkv.cli.serve)
    jaxkv bench serving --quick                                     (jaxkv.cli.bench)
    jaxkv experiment configs/experiments/smoke.yaml --dry-run       (jaxkv.cli.experiment)
    jaxkv train-mqar configs/mqar.yaml                              (jaxkv.cli.train_mqar)
    jaxkv launch --num-processes 2 -- generate ...                  (jaxkv.cli.launch)
    jaxkv tokenizer --model smollm2 --out DIR                       (jaxkv.cli.tokenizer)

The decode benchmark is a script of the source checkout: ``python scripts/bench_decode.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import sys
import warnings

from jaxkv.cli import bench, chat, experiment, generate, launch, serve, tokenizer, train_mqar

# Each subcommand's module (``add_parser(sub)``, ``run(args)``), in the order ``--help`` lists them.
SUBCOMMANDS = {
    "generate": generate, "chat": chat, "bench": bench, "serve": serve, "train-mqar": train_mqar,
    "experiment": experiment, "launch": launch, "tokenizer": tokenizer,
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description="Functional KV caches for JAX models")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    return parser


# The modules a command needs beyond the core install, by the extra of pyproject.toml that installs them
# (tests/app/test_architecture.py checks these against pyproject).
EXTRAS = {"serve": ("fastapi", "uvicorn", "prometheus_client"), "research": ("optax", "matplotlib", "gensim")}
COMMAND_EXTRAS = {"serve": "serve", "experiment": "research", "train-mqar": "research"}


class MissingExtra(ImportError):
    """A command's optional dependencies are not installed; the message names the extra to install."""


def _check_extra(command: str) -> None:
    """Raise ``MissingExtra`` before ``command`` runs (not deep into it) when a module of its extra is missing."""
    extra = COMMAND_EXTRAS.get(command)
    missing = [name for name in EXTRAS.get(extra, ()) if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtra(
            f"jaxkv {command} needs the {extra} extra ({', '.join(missing)} not installed): "
            f"pip install 'jaxkv[{extra}]'"
        )


# Names that moved to a subcommand's module: still importable from here, with a warning.
_MOVED = {
    **dict.fromkeys(("ServeConfig", "resolve_serve_config", "SERVE_FLAGS"), "jaxkv.cli.serve"),
    **dict.fromkeys(("GenerateConfig", "resolve_config", "cache_options", "cache_settings", "QUANT_FLAGS"),
                    "jaxkv.cli.generate"),
    "BENCHMARKS": "jaxkv.cli.bench", "MESH_HELP": "jaxkv.config",
}  # fmt: skip


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"jaxkv.cli.main.{name} moved to {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_extra(args.command)
        with one_line_warnings():
            return SUBCOMMANDS[args.command].run(args)
    except (ValueError, FileNotFoundError, MissingExtra) as error:
        print(f"jaxkv: error: {error}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def one_line_warnings():
    """Warnings as ``jaxkv: warning: ...`` lines, without the file, line and source of the code
    that raised them (a mesh axis that cannot split the K/V heads: what to do is in the text)."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"jaxkv: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
