"""Command-line flags of the engine's settings, generated from their one definition.

``EngineConfig`` and its sections (``QuantSpec``, ``EvictionSpec``, ``RetrievalSpec``,
``SpeculativeConfig``) are the only places an engine setting is declared: each field's flag is
made here from its name, type, default and attribute docstring, the way vLLM's
``EngineArgs.add_cli_args`` does. ``jaxkv serve``, ``jaxkv bench serving`` and the scripts add
them with ``add_engine_flags`` and read them back with ``engine_settings``:

    add_engine_flags(parser)                                     # --kv-memory, --page-size, ...
    settings = engine_settings(parser.parse_args(), base={})     # a dict of the flags given
    engine, tokenizer = load_engine("smollm2", TypeAdapter(EngineConfig).validate_python(settings))

A top-level field ``page_size`` is ``--page-size``; a section's field is prefixed with the
section, ``speculative.num_tokens`` is ``--speculative-num-tokens``. A retrieval section's pages
are the pool's: its ``page_size`` is the engine's and its ``prefill`` 'dense' unless it says. A section flag given while
the section is off needs the section's switch (``SECTION_SWITCHES``: ``--speculative-method``,
``--retrieval-budget``, ``--eviction-policy``, ``--quantization-nbits``), or the section in the
YAML config, so a tuning flag never turns a feature on by itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Callable

from pydantic import TypeAdapter

from jaxkv.serving.engine_config import EngineConfig, field_docs

# Each section of EngineConfig and the field whose flag turns it on.
SECTION_SWITCHES = {"quantization": "nbits", "eviction": "policy", "speculative": "method", "retrieval": "budget"}
# Section fields that are not flags: the retrieval section's pages are the pool's (``page_size``).
NOT_FLAGS = {("retrieval", "page_size")}
# Old spellings still accepted, each with a warning naming its replacement.
DEPRECATED_FLAGS = {"--speculative-tokens": "--speculative-num-tokens", "--draft-model": "--speculative-draft-model",
                    "--always-verify": "--speculative-always-verify"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Flag:
    """One setting's flag: ``section`` (None: a top-level field) and ``name`` locate the field."""

    section: str | None
    name: str
    kind: type
    choices: tuple | None
    help: str

    @property
    def dest(self) -> str:
        """The argparse attribute: ``page_size``, ``speculative_num_tokens``."""
        return self.name if self.section is None else f"{self.section}_{self.name}"

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")


def _flag_type(annotation) -> tuple[type, tuple | None]:
    """The flag's value type and choices for a field annotation: a ``Literal`` gives its choices,
    ``X | None`` is ``X``'s, a size (``int | str``), a path or a model (``object``) is text."""
    if typing.get_origin(annotation) is typing.Literal:
        choices = typing.get_args(annotation)
        return type(choices[0]), choices
    members = [a for a in typing.get_args(annotation) if a is not type(None)] if _is_union(annotation) else [annotation]
    if len(members) == 1 and members[0] in (int, float, bool):
        return members[0], None
    if len(members) == 1 and typing.get_origin(members[0]) is typing.Literal:
        return _flag_type(members[0])
    return str, None


def _is_union(annotation) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _section_type(annotation) -> type | None:
    """The dataclass a section field holds (``QuantSpec | None`` -> ``QuantSpec``), else None."""
    members = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    found = [m for m in members if dataclasses.is_dataclass(m)]
    return found[0] if found else None


def _flags_of(schema: type, section: str | None) -> list[Flag]:
    hints, docs = typing.get_type_hints(schema), field_docs(schema)
    flags = []
    for field in dataclasses.fields(schema):
        if (section, field.name) in NOT_FLAGS or _section_type(hints[field.name]) is not None:
            continue
        kind, choices = _flag_type(hints[field.name])
        default = "" if field.default is dataclasses.MISSING else f" (default: {field.default})"
        one_of = "" if choices is None else f" One of: {', '.join(map(str, choices))}."
        flags.append(Flag(section, field.name, kind, choices, docs[field.name] + one_of + default))
    return flags


def engine_flags() -> list[Flag]:
    """Every flag of ``EngineConfig``: its own fields, then each section's."""
    hints = typing.get_type_hints(EngineConfig)
    flags = _flags_of(EngineConfig, None)
    for section in SECTION_SWITCHES:
        flags += _flags_of(_section_type(hints[section]), section)
    return flags


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add every engine setting's flag to ``parser`` (``skip``: flag dests the command sets itself),
    in one argument group per section; each defaults to None, "not given"."""
    groups = {None: parser.add_argument_group("engine (EngineConfig)")}
    for section in SECTION_SWITCHES:
        switch = "--" + f"{section}_{SECTION_SWITCHES[section]}".replace("_", "-")
        groups[section] = parser.add_argument_group(f"engine: {section} (off unless {switch} or a config section)")
    for flag in engine_flags():
        if flag.dest in skip:
            continue
        aliases = [old for old, new in DEPRECATED_FLAGS.items() if new == flag.option]
        options = {"action": argparse.BooleanOptionalAction} if flag.kind is bool else {"type": flag.kind}
        # No argparse choices: a bad value is refused by the schema, naming the field, like a config's.
        groups[flag.section].add_argument(flag.option, *aliases, dest=flag.dest, default=None,
                                          help=flag.help.replace("%", "%%"), **options)  # fmt: skip


def engine_settings(args: argparse.Namespace, base: dict, without: tuple[str, ...] = ()) -> dict:
    """``base`` (an ``EngineConfig`` as a dict, from a config file, or ``{}``) with the engine flags
    given in ``args`` on top; raises ``ValueError`` naming a section flag given without its switch.
    ``without``: sections the caller builds itself (from ``section_flags``), left out here."""
    _warn_deprecated(sys.argv[1:])
    settings = dict(base)
    for flag in engine_flags():
        if flag.section is None and getattr(args, flag.dest, None) is not None:
            settings[flag.name] = getattr(args, flag.dest)
    for section, switch in SECTION_SWITCHES.items():
        options = section_flags(args, section)
        if not options or section in without:
            continue
        if settings.get(section) is None and switch not in options:
            named = ", ".join(f.option for f in engine_flags() if f.section == section and f.name in options)
            raise ValueError(f"{named} tune {section}: add --{section}-{switch.replace('_', '-')} (or a {section}: "
                             f"config section)")  # fmt: skip
        settings[section] = as_dict(settings.get(section)) | options
    return with_pool_retrieval(settings)


def with_pool_retrieval(settings: dict) -> dict:
    """``settings`` (an ``EngineConfig`` as a dict) with its retrieval section, if any, over the
    engine's pool: its ``page_size`` the engine's and its ``prefill`` 'dense' (Quest's prefill:
    a prompt's tokens read every page) unless the section says otherwise."""
    if settings.get("retrieval") is None:
        return settings
    defaults = {"prefill": "dense", "page_size": settings.get("page_size", EngineConfig.page_size)}
    return settings | {"retrieval": defaults | as_dict(settings["retrieval"])}


def section_flags(args: argparse.Namespace, section: str) -> dict:
    """The flags of ``section`` given in ``args``, by field name."""
    flags = [flag for flag in engine_flags() if flag.section == section]
    return {flag.name: getattr(args, flag.dest) for flag in flags if getattr(args, flag.dest, None) is not None}


def engine_config(args: argparse.Namespace, base: dict | None = None, without: tuple[str, ...] = ()) -> EngineConfig:
    """The ``EngineConfig`` of ``base`` (a dict of its fields, e.g. a config file's section) with
    the engine flags given in ``args`` on top (``without``: as ``engine_settings``), validated
    (pydantic, then its own checks)."""
    return TypeAdapter(EngineConfig).validate_python(engine_settings(args, base or {}, without))


def engine_argv(config: EngineConfig) -> list[str]:
    """The command-line flags that give ``config`` (each field that differs from its default), for
    starting ``jaxkv serve`` with the settings of an engine built here."""
    defaults, argv = EngineConfig(), []
    for flag in engine_flags():
        value = _value(config, flag)
        if value is None or value == _value(defaults, flag) and flag.section is None:
            continue
        if flag.kind is bool:
            argv.append(flag.option if value else "--no-" + flag.option[2:])
        else:
            argv += [flag.option, str(value)]
    return argv


def _value(config: EngineConfig, flag: Flag):
    """``flag``'s field in ``config`` (None when its section is off)."""
    holder = config if flag.section is None else getattr(config, flag.section)
    return None if holder is None else getattr(holder, flag.name)


def as_dict(section) -> dict:
    """A config or section as a dict of its fields, not copied (a dataclass, a dict from YAML, or
    None: empty)."""
    if section is None:
        return {}
    if dataclasses.is_dataclass(section):
        return {field.name: getattr(section, field.name) for field in dataclasses.fields(section)}
    return dict(section)


def _warn_deprecated(argv: list[str]) -> None:
    for arg in argv:
        old = arg.split("=", 1)[0]
        if old in DEPRECATED_FLAGS:
            print(f"jaxkv: warning: {old} is deprecated; use {DEPRECATED_FLAGS[old]}", file=sys.stderr)


def load_engine(
    model: str | os.PathLike, config: EngineConfig, *, mesh=None, load: Callable | None = None, **load_options
):
    """``(engine, tokenizer)``: the model (and the speculative section's ``draft_model``, when it
    names one) loaded with ``jaxkv.models.load.load_pretrained`` (or ``load``, same signature) and
    the engine over them; the one way serve, the benchmarks and the scripts build an engine.
    ``load_options`` go to ``load`` for the target (``weights="gguf"``...)."""
    from jaxkv.models.load import load_pretrained
    from jaxkv.serving import Engine

    load = load or load_pretrained
    target, tokenizer = load(model, mesh=mesh, **load_options)  # the engine shards its pools like the model
    return Engine(target, with_draft_model(config, load, mesh), tokenizer=tokenizer), tokenizer


def with_draft_model(config: EngineConfig, load: Callable, mesh=None) -> EngineConfig:
    """``config`` with its speculative ``draft_model`` (a name, directory or .gguf) replaced by the
    loaded model; unchanged when there is none or it is loaded already."""
    speculative = config.speculative
    if speculative is None or not isinstance(speculative.draft_model, str | os.PathLike):
        return config
    draft = load(speculative.draft_model, mesh=mesh)[0]  # its tokenizer is the target's
    return dataclasses.replace(config, speculative=dataclasses.replace(speculative, draft_model=draft))
