"""Validated experiment configs: YAML in, typed objects out, typos named with their file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, TypeVar

import yaml
from jax.sharding import Mesh
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError, model_validator

from jaxkv.eviction import POLICIES, EvictionSpec
from jaxkv.retrieval import PAGE_ORDERS, PREFILLS, SUMMARIES, RetrievalSpec
from jaxkv.quantization import QuantSpec
from jaxkv.sharding import DATA, MODEL, make_mesh, parse_mesh


class Strict(BaseModel):
    """Unknown keys and wrong types are errors, not silently ignored or coerced."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class QuantizationConfig(Strict):
    """A quantized K/V cache (``jaxkv.layers.quantized.QuantSpec``; the reference's option names
    and defaults): ``nbits`` 2/4/8 for 'int' (default 4), 8 for 'e4m3'/'e5m2'; axes 0 per
    token, -1 per channel."""

    nbits: Literal[2, 4, 8] | None = None
    format: Literal["int", "e4m3", "e5m2"] = "int"
    axis_key: Literal[0, -1] = 0
    axis_value: Literal[0, -1] = 0
    q_group_size: PositiveInt = 64
    residual_length: NonNegativeInt = 128

    @model_validator(mode="after")
    def _consistent(self):
        self.spec()  # cross-field rules (fp8 bits, per-channel residual) raise here
        return self

    def spec(self) -> QuantSpec:
        return QuantSpec(**self.model_dump())


class EvictionConfig(Strict):
    """An eviction policy (``jaxkv.eviction.EvictionSpec`` without its budget, which an experiment
    grid's budgets give): ``window`` recent and ``sinks`` first positions always kept (None: the
    policy's default), SnapKV's pooling ``kernel_size``, PyramidKV's steepness ``beta``."""

    policy: Literal[POLICIES]
    window: NonNegativeInt | None = None
    sinks: NonNegativeInt | None = None
    kernel_size: PositiveInt = 5
    beta: Annotated[float, Field(ge=1.0)] = 20.0

    @model_validator(mode="after")
    def _odd_kernel(self):
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (SnapKV pools over a centred window), got {self.kernel_size}")
        return self

    def spec(self, budget: int) -> EvictionSpec:
        """The policy keeping ``budget`` slots per row, K/V head and layer."""
        return EvictionSpec(budget=budget, **self.model_dump())


class BudgetedEvictionConfig(EvictionConfig):
    """An eviction policy with its budget (``jaxkv serve``): ``budget`` slots per row, K/V head and
    layer, or ``compression_ratio``, the fraction of the longest sequence evicted; exactly one."""

    budget: PositiveInt | None = None
    compression_ratio: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None

    @model_validator(mode="after")
    def _one_budget(self):
        self.budgeted_spec()  # exactly one of budget and compression_ratio, and the policy's own rules
        return self

    def budgeted_spec(self) -> EvictionSpec:
        return EvictionSpec(**self.model_dump())


class RetrievalConfig(Strict):
    """Page retrieval attention (``jaxkv.retrieval.RetrievalSpec``): each query reads ``budget``
    tokens (a multiple of ``page_size``) of every full-attention layer, the ``sink`` first and
    ``recent`` last pages always, the rest chosen by their ``summary``; ``pages``: 'sequential', or
    'clustered' (a prefill's pages hold similar keys); ``prefill``: 'retrieve', or 'dense' (an update of
    more than a page per row attends every token, as Quest's prefill); ``dense_layers``: the model's
    first N layers read every token."""

    budget: PositiveInt
    page_size: PositiveInt = 16
    sink: NonNegativeInt = 1
    recent: PositiveInt = 1
    summary: Literal[SUMMARIES] = "minmax"
    pages: Literal[PAGE_ORDERS] = "sequential"
    prefill: Literal[PREFILLS] = "retrieve"
    dense_layers: NonNegativeInt = 0  # the model's first N layers read every token (Quest's first two)

    @model_validator(mode="after")
    def _consistent(self):
        self.spec()  # the budget holds whole pages, the sink and the recent pages
        return self

    def spec(self) -> RetrievalSpec:
        return RetrievalSpec(**self.model_dump())


class CacheConfig(Strict):
    """How to build a ``Cache`` (the keyword arguments of ``Cache.from_config``)."""

    full_attention: Literal["static", "dynamic"] = "static"
    max_length: PositiveInt | None = None
    rollback_slots: NonNegativeInt = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    quantization: QuantizationConfig | None = None
    retrieval: RetrievalConfig | None = None  # full-attention layers read a budget of pages per query
    # K/V of these layers in host memory, one layer at a time on the device (jaxkv.offload; retrieval
    # layers: the pages a query reads): true (full-attention layers), "all", a layer type, or a
    # list of layer types and layer indices.
    offload: bool | str | list[str | int] | None = None

    def quantization_spec(self) -> QuantSpec | None:
        return None if self.quantization is None else self.quantization.spec()

    def retrieval_spec(self) -> RetrievalSpec | None:
        return None if self.retrieval is None else self.retrieval.spec()


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
