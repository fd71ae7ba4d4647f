"""Validated experiment configs: YAML in, typed objects out, typos named with their file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, TypeVar

import yaml
from jax.sharding import Mesh
from pydantic import AfterValidator, BaseModel, ConfigDict, NonNegativeInt, PositiveInt, ValidationError

from jaxkv.eviction import EvictionSpec
from jaxkv.retrieval import RetrievalSpec
from jaxkv.quantization import QuantSpec
from jaxkv.sharding import DATA, MODEL, make_mesh, parse_mesh


class Strict(BaseModel):
    """Unknown keys and wrong types are errors, not silently ignored or coerced."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _unbudgeted_eviction(section: dict) -> dict:
    """``section`` if it is an ``EvictionSpec`` but for its budget (checked with one slot)."""
    if "budget" in section or "compression_ratio" in section:
        raise ValueError("an experiment's eviction policy takes its budget from the grid's budgets: drop budget")
    EvictionSpec(**section | {"budget": 1})
    return section


# An eviction policy without its budget (an experiment grid's budgets give it): an ``EvictionSpec``'s
# fields but ``budget`` and ``compression_ratio``, checked by ``EvictionSpec`` itself.
EvictionPolicy = Annotated[dict[str, str | int | float | None], AfterValidator(_unbudgeted_eviction)]


def eviction_spec(policy: dict, budget: int) -> EvictionSpec:
    """The ``EvictionPolicy`` ``policy`` keeping ``budget`` slots per row, K/V head and layer."""
    return EvictionSpec(**policy | {"budget": budget})


class CacheConfig(Strict):
    """How to build a ``Cache`` (the keyword arguments of ``Cache.from_config``)."""

    full_attention: Literal["static", "dynamic"] = "static"
    max_length: PositiveInt | None = None
    rollback_slots: NonNegativeInt = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    quantization: QuantSpec | None = None
    retrieval: RetrievalSpec | None = None  # full-attention layers read a budget of pages per query
    # K/V of these layers in host memory, one layer at a time on the device (jaxkv.offload; retrieval
    # layers: the pages a query reads): true (full-attention layers), "all", a layer type, or a
    # list of layer types and layer indices.
    offload: bool | str | list[str | int] | None = None


# How a model's matrices are held (``jaxkv.models.load.WEIGHTS``): the CLI's --weights, the YAML's weights:.
Weights = Literal["dense", "gguf", "int8", "int4"]
WEIGHTS_HELP = (
    "how the model's matrices are held: dense (--dtype), gguf (a GGUF file's own blocks, computed on by jaxkv's "
    "kernels; the default for a GGUF on one device), int8 or int4 (quantized at load: q8_0 / q4_1 blocks of 32)"
)

MESH_HELP = (
    "shard over a device mesh, e.g. data=2,model=4 (batch rows over data; heads, MLP and vocabulary over model); "
    "the sizes multiply to the device count"
)


class MeshConfig(Strict):
    """A device mesh (``jaxkv.sharding.make_mesh``): data parallel over ``data`` (batch rows),
    tensor parallel over ``model`` (heads, MLP, vocabulary). The sizes multiply to the device
    count: every process's devices under ``jax.distributed``."""

    data: PositiveInt = 1
    model: PositiveInt = 1

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """``--mesh data=2,model=4``; an unknown axis or a bad size is a one-line error."""
        try:
            return cls.model_validate(parse_mesh(text))
        except ValidationError as error:
            raise ValueError(f"--mesh {text}: {describe(error)} (the axes are data and model)") from error

    def shape(self) -> dict[str, int]:
        return {DATA: self.data, MODEL: self.model}

    def build(self) -> Mesh:
        """The ``jax.sharding.Mesh`` (after ``jax.distributed`` is initialized, if it is used)."""
        return make_mesh(self.shape())


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
        raise ConfigError(f"{path}: {describe(error)}") from error


def describe(error: ValidationError) -> str:
    """Each problem of ``error`` on one line: ``key.path: message; ...``."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '<top level>'}: {e['msg']}" for e in error.errors())
