"""Every setting is defined once: ``EngineConfig`` and its sections are the only definitions of
their fields, each documented where it is declared; the command lines generate their flags from
them; no pydantic model, signature or flag list spells those fields again. A field added in one
place and not the others fails here."""

import argparse
import dataclasses
import importlib
import inspect
import pkgutil
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

import jaxkv
from jaxkv.cache import Cache, LayerSpec
from jaxkv.cli.main import build_parser
from jaxkv.cli.serve import ServeConfig
from jaxkv.engine_args import NOT_FLAGS, SECTION_SWITCHES, engine_argv, engine_config, engine_flags
from jaxkv.eviction import EvictionSpec
from jaxkv.quantization import QuantSpec
from jaxkv.retrieval import RetrievalSpec
from jaxkv.serving import Engine, EngineConfig
from jaxkv.serving.engine_config import field_docs
from jaxkv.serving.engine_thread import EngineThread
from jaxkv.serving.input_processor import InputProcessor
from jaxkv.serving.requests import RequestOptions
from jaxkv.serving.speculation import SpeculativeConfig

ROOT = Path(__file__).resolve().parents[2]
SPECS = (EngineConfig, QuantSpec, EvictionSpec, RetrievalSpec, SpeculativeConfig)


def fields(cls) -> set[str]:
    return {field.name for field in dataclasses.fields(cls)}


def setting_fields() -> set[tuple[str | None, str]]:
    """Every engine setting as (section or None, field), the sections' own switches included."""
    hints = typing.get_type_hints(EngineConfig)
    found = {(None, name) for name in fields(EngineConfig) - set(SECTION_SWITCHES)}
    for section in SECTION_SWITCHES:
        spec = next(arg for arg in typing.get_args(hints[section]) if dataclasses.is_dataclass(arg))
        found |= {(section, name) for name in fields(spec)}
    return found - NOT_FLAGS


def parser_dests(parser: argparse.ArgumentParser) -> set[str]:
    return {action.dest for action in parser._actions}


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.__name__)
def test_every_field_is_documented_where_it_is_declared(spec):
    assert set(field_docs(spec)) == fields(spec)


def test_every_engine_setting_has_one_generated_flag():
    flags = {(flag.section, flag.name) for flag in engine_flags()}
    assert flags == setting_fields()
    assert len({flag.option for flag in engine_flags()}) == len(engine_flags())


def test_serve_takes_every_engine_flag():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert {flag.dest for flag in engine_flags()} <= parser_dests(serve)


def test_the_load_test_takes_every_engine_flag_but_its_workload_seed():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        load_test = importlib.import_module("load_test")
        args = load_test.parse_args(["--kv-memory", "3MiB", "--max-pages-per-request", "8"])
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert {flag.dest for flag in engine_flags()} - {"seed"} <= set(vars(args))
    assert (args.engine.kv_memory, args.engine.max_pages_per_request, args.engine.seed) == ("3MiB", 8, 0)


def test_the_serving_benchmark_takes_every_engine_flag_but_its_own_two():
    """``jaxkv bench serving``: its ``--seed`` is the workload's, and each speculating system picks
    its method; the rest are the engine's flags, the systems' base engine."""
    from jaxkv.bench.serving import cli

    args = cli.parse_args(["--max-pages-per-request", "12", "--preemption", "swap"])
    assert {flag.dest for flag in engine_flags()} - {"seed", "speculative_method"} <= set(vars(args))
    assert (args.engine.max_pages_per_request, args.engine.preemption, args.engine.max_num_seqs) == (12, "swap", 32)


def test_serve_config_holds_the_engine_as_a_section_not_a_copy():
    assert ServeConfig.model_fields["engine"].annotation is EngineConfig
    assert not set(ServeConfig.model_fields) & fields(EngineConfig)


def application_models() -> list[type[BaseModel]]:
    """Every pydantic model of jaxkv's configs, command line, server and research code."""
    names = ["jaxkv.config", "jaxkv.engine_args"]
    for package in ("jaxkv.cli", "jaxkv.server", "jaxkv.research"):
        module = importlib.import_module(package)
        names += [f"{package}.{info.name}" for info in pkgutil.iter_modules(module.__path__) if info.name != "__main__"]
    found = set()
    for name in names:
        for _, cls in inspect.getmembers(importlib.import_module(name), inspect.isclass):
            if issubclass(cls, BaseModel) and cls.__module__.startswith("jaxkv."):
                found.add(cls)
    return sorted(found, key=lambda cls: cls.__qualname__)


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.__name__)
def test_no_pydantic_model_mirrors_a_spec(spec):
    """A model sharing half a spec's fields would be a second definition of them."""
    mirrors = [model.__qualname__ for model in application_models()
               if len(set(model.model_fields) & fields(spec)) * 2 >= len(fields(spec))]  # fmt: skip
    assert mirrors == []


def test_request_options_are_passed_whole():
    """``RequestOptions`` is the one spelling of a request's options: no signature on its way to
    the engine lists its fields (``sampling`` stays positional in ``add_request``)."""
    for function in (Engine.add_request, EngineThread.submit, InputProcessor.process):
        assert set(inspect.signature(function).parameters) & fields(RequestOptions) <= {"sampling"}, function


def test_from_layer_types_takes_a_layer_spec():
    parameters = set(inspect.signature(Cache.from_layer_types).parameters)
    assert "spec" in parameters and not parameters & fields(LayerSpec)


def test_engine_argv_gives_back_the_config():
    """The flags ``engine_argv`` writes for a config (``load_test`` starts ``jaxkv serve`` with
    them) parse back to the same config."""
    parser = argparse.ArgumentParser()
    jaxkv.engine_args.add_engine_flags(parser)
    budgeted = EngineConfig(kv_memory="2MiB", page_size=8, prefix_caching=False, max_pages_per_request=6,
                            compaction_policy="key_norm")  # fmt: skip
    speculating = EngineConfig(seed=3, speculative=SpeculativeConfig(num_tokens=3), retrieval=None)
    for config in (budgeted, speculating):
        assert engine_config(parser.parse_args(engine_argv(config))) == config
