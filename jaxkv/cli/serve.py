"""``jaxkv serve``: an OpenAI-compatible HTTP server over the serving engine (``jaxkv.server``).

``ServeConfig`` holds the server's own settings and an ``engine`` section, which is
``EngineConfig`` itself (validated by pydantic, then by its own checks); the engine's flags are
generated from it (``jaxkv.engine_args``). A YAML config (``--config``) sets any of them and the
flags given override it. A config that still writes an engine setting at the top level (the
layout before the ``engine`` section) is read with a deprecation warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path
from typing import get_args

from pydantic import PositiveInt, model_validator

from jaxkv.config import MESH_HELP, WEIGHTS_HELP, MeshConfig, Strict, Weights, load_config
from jaxkv.engine_args import add_engine_flags, as_dict, engine_settings, load_engine, with_pool_retrieval
from jaxkv.serving.engine_config import EngineConfig

ENGINE_FIELDS = tuple(field.name for field in dataclasses.fields(EngineConfig))
SERVE_FLAGS = ("model", "weights", "served_model_name", "host", "port", "max_waiting")


class ServeConfig(Strict):
    """What ``jaxkv serve`` runs; ``--config FILE`` (YAML, e.g. configs/serve.yaml) sets any of these."""

    model: str = "smollm2"
    weights: Weights | None = None  # how the model's matrices are held: jaxkv.models.load.WEIGHTS (None: its default)
    served_model_name: str | None = None  # the name clients pass as `model` (default: model)
    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting: PositiveInt = 64  # queued requests before answering 503
    mesh: MeshConfig | None = None  # shard the model and the page pools over the devices (this process's)
    engine: EngineConfig = EngineConfig()  # the engine's settings: jaxkv.serving.engine_config

    @model_validator(mode="before")
    @classmethod
    def _engine_section(cls, data):
        """Engine settings written at the top level (the old layout) move into ``engine``, with a
        warning; a retrieval section reads the engine's pool (``with_pool_retrieval``)."""
        if not isinstance(data, dict):
            return data
        flat = [key for key in data if key in ENGINE_FIELDS]
        if flat:
            warnings.warn(f"serve config: {', '.join(flat)} belong in the engine: section now (the top-level "
                          f"spelling is deprecated)", DeprecationWarning, stacklevel=2)  # fmt: skip
        engine = with_pool_retrieval({key: data[key] for key in flat} | as_dict(data.get("engine")))
        return {key: value for key, value in data.items() if key not in flat} | {"engine": engine}

    @model_validator(mode="after")
    def _eviction_without_prefix_caching(self):
        if self.engine.eviction is not None and self.engine.prefix_caching:
            raise ValueError(
                "eviction keeps each request's K/V in its own slots, which prefix caching cannot share: set "
                "engine.prefix_caching: false (or --no-prefix-caching)"
            )
        return self


def add_parser(sub) -> None:
    parser = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the serving engine")
    parser.add_argument("--config", type=Path, help="YAML file (configs/serve.yaml); flags below override it")
    parser.add_argument("--model", help="embedded default name, a checkpoint directory or a .gguf (default smollm2)")
    parser.add_argument("--weights", choices=get_args(Weights), help=WEIGHTS_HELP)
    parser.add_argument("--served-model-name", help="the name clients pass as `model` (default: --model)")
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="default 8000")
    parser.add_argument("--max-waiting", type=int, help="queued requests before answering 503 (default 64)")
    parser.add_argument("--mesh", help=MESH_HELP + " (this process's devices)")
    add_engine_flags(parser)


def resolve_serve_config(args: argparse.Namespace) -> ServeConfig:
    """The YAML config (if any) with the command-line flags on top, validated as a whole."""
    merged = load_config(args.config, ServeConfig).model_dump() if args.config else {}
    merged |= {key: getattr(args, key) for key in SERVE_FLAGS if getattr(args, key) is not None}
    engine = as_dict(merged.get("engine"))
    if engine.get("retrieval") is not None:  # the file's page size was filled in: the flags' may differ
        engine["retrieval"] = {k: v for k, v in as_dict(engine["retrieval"]).items() if k != "page_size"}
    merged["engine"] = engine_settings(args, engine)
    if args.mesh is not None:
        merged["mesh"] = MeshConfig.parse(args.mesh).model_dump()
    return ServeConfig.model_validate(merged)


def run(args: argparse.Namespace) -> int:
    """Load, build the engine, compile every step shape, then serve until SIGINT/SIGTERM."""
    from jaxkv.server.api import Server, serve
    from jaxkv.serving.engine_thread import EngineThread

    config = resolve_serve_config(args)
    mesh = None if config.mesh is None else config.mesh.build()
    engine, tokenizer = load_engine(config.model, config.engine, mesh=mesh, weights=config.weights)
    if tokenizer is None:
        raise ValueError(f"{config.model} has no tokenizer: the server needs one for text prompts and outputs")
    start = time.perf_counter()
    engine.warmup()
    name = config.served_model_name or config.model
    print(f"jaxkv serve: {name} ready at http://{config.host}:{config.port}/v1 (compiled in "
          f"{time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
    serve(Server(EngineThread(engine, config.max_waiting).start(), tokenizer, name), config.host, config.port)
    return 0
