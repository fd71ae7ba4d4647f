"""Validated experiment configs: YAML in, typed objects out, typos named with their file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, ValidationError


class Strict(BaseModel):
    """Unknown keys and wrong types are errors, not silently ignored or coerced."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class CacheConfig(Strict):
    """How to build a ``Cache`` (the keyword arguments of ``Cache.from_config``)."""

    full_attention: Literal["static", "dynamic"] = "static"
    max_length: PositiveInt | None = None
    rollback_slots: NonNegativeInt = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


Schema = TypeVar("Schema", bound=BaseModel)


class ConfigError(ValueError):
    pass


def load_config(path: str | Path, schema: type[Schema]) -> Schema:
    """Read ``path`` (YAML) into ``schema``; errors name the file and each bad key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    try:
        return schema.model_validate(data or {})
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '<top level>'}: {e['msg']}" for e in error.errors()
        )
        raise ConfigError(f"{path}: {problems}") from error
