"""The container: one cache layer per model layer, chosen from the config's ``layer_types``.

``Cache`` only routes. Model code calls one line per attention layer:

    cache, (k, v, mask_info) = cache.update(layer_idx, k, v, positions)

and never sees how a layer stores its K/V. Every operation returns a new ``Cache``; the
old one is untouched, so a prefilled prefix can seed many continuations without a copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.dynamic import DynamicLayer
from jaxkv.protocol import CacheLayer, KVView, is_traced
from jaxkv.static import StaticLayer
from jaxkv.windowed import ChunkedLayer, SlidingWindowLayer

FULL_ATTENTION_KINDS = ("static", "dynamic")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Everything a layer builder may need; each builder checks the fields it uses."""

    batch_size: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = jnp.float32
    max_length: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    full_attention: str = "static"
    rollback_slots: int = 0


def _full_attention_layer(spec: LayerSpec) -> CacheLayer:
    if spec.full_attention == "dynamic":
        return DynamicLayer.create(spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.dtype)
    if spec.max_length is None:
        raise ValueError("a static full-attention cache needs max_length; pass it, or use full_attention='dynamic'")
    return StaticLayer.create(spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.max_length, spec.dtype)


def _sliding_layer(spec: LayerSpec) -> CacheLayer:
    if not spec.sliding_window:
        raise ValueError("layer type 'sliding_attention' needs the config's sliding_window (a positive int)")
    return SlidingWindowLayer.create(
        spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.sliding_window, spec.dtype, spec.rollback_slots
    )


def _chunked_layer(spec: LayerSpec) -> CacheLayer:
    if not spec.attention_chunk_size:
        raise ValueError("layer type 'chunked_attention' needs the config's attention_chunk_size (a positive int)")
    return ChunkedLayer.create(
        spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.attention_chunk_size, spec.dtype, spec.rollback_slots
    )


# The config's layer_types value -> how to build that layer. Later layer families
# (linear_attention, hybrid, quantized) register here; nothing else changes.
LAYER_TYPES: dict[str, Callable[[LayerSpec], CacheLayer]] = {
    "full_attention": _full_attention_layer,
    "sliding_attention": _sliding_layer,
    "chunked_attention": _chunked_layer,
}


def _config_value(config, key, default=None):
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def layer_types_of(config) -> list[str]:
    """The per-layer types a config declares; configs without ``layer_types`` (Llama,
    Mistral) get all full, or all sliding when a sliding window is in use."""
    num_layers = _config_value(config, "num_hidden_layers")
    layer_types = _config_value(config, "layer_types")
    if layer_types is None:
        if num_layers is None:
            raise ValueError("config has neither layer_types nor num_hidden_layers")
        sliding = _config_value(config, "sliding_window") and _config_value(config, "use_sliding_window", True)
        return ["sliding_attention" if sliding else "full_attention"] * num_layers
    if num_layers is not None and len(layer_types) != num_layers:
        raise ValueError(f"config lists {len(layer_types)} layer_types but num_hidden_layers is {num_layers}")
    return list(layer_types)


@struct.dataclass
class Cache:
    """A tuple of cache layers, one per model layer, with batch-level operations.

    All layers see the same tokens, so they agree on ``lengths``. Every method is pure and
    jittable except ``reserve`` (it reads lengths to pick a shape).
    """

    layers: tuple
    layer_types: tuple[str, ...] = struct.field(pytree_node=False)

    # --- construction -------------------------------------------------------------
    @classmethod
    def from_layer_types(
        cls,
        layer_types: Sequence[str],
        *,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.float32,
        max_length: int | None = None,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
        full_attention: str = "static",
        rollback_slots: int = 0,
    ) -> Cache:
        """One layer per entry of ``layer_types`` (keys of ``LAYER_TYPES``).

        ``full_attention``: 'static' (preallocated ``max_length``) or 'dynamic' (grows).
        ``rollback_slots``: extra ring slots, so windowed layers can undo that many tokens
        plus one (a bare ring already allows one).
        """
        if full_attention not in FULL_ATTENTION_KINDS:
            raise ValueError(f"full_attention must be one of {FULL_ATTENTION_KINDS}, got {full_attention!r}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unknown layer type(s) {unknown}; known layer types: {sorted(LAYER_TYPES)}")
        spec = LayerSpec(
            batch_size, num_kv_heads, head_dim, jnp.dtype(dtype), max_length,
            sliding_window, attention_chunk_size, full_attention, rollback_slots,
        )  # fmt: skip
        return cls(tuple(LAYER_TYPES[t](spec) for t in layer_types), tuple(layer_types))

    @classmethod
    def from_config(cls, config, batch_size: int, **kwargs) -> Cache:
        """Build from a model config (dict or object with HF-style attribute names).

        Reads ``layer_types`` (or infers it), ``num_key_value_heads``, ``head_dim`` (or
        ``hidden_size // num_attention_heads``), ``sliding_window``,
        ``attention_chunk_size``. ``kwargs`` go to ``from_layer_types``.
        """
        num_heads = _config_value(config, "num_attention_heads")
        num_kv_heads = _config_value(config, "num_key_value_heads") or num_heads
        head_dim = _config_value(config, "head_dim")
        if head_dim is None:
            hidden = _config_value(config, "hidden_size")
            if hidden is None or not num_heads:
                raise ValueError("config needs head_dim, or hidden_size and num_attention_heads")
            head_dim = hidden // num_heads
        if not num_kv_heads:
            raise ValueError("config needs num_key_value_heads or num_attention_heads")
        return cls.from_layer_types(
            layer_types_of(config),
            batch_size=batch_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            sliding_window=_config_value(config, "sliding_window"),
            attention_chunk_size=_config_value(config, "attention_chunk_size"),
            **kwargs,
        )

    # --- the one call model code makes -------------------------------------------
    def update(self, layer_idx: int, keys, values, positions=None) -> tuple[Cache, KVView]:
        """Store new K/V ``[B, H_kv, T, D]`` of layer ``layer_idx``; return what attention reads.

        ``positions`` ``[B, T]`` (negative = padding) default to the T positions after this
        layer's length. A model computes them once per forward (``next_positions``) before
        the first layer runs: mid-forward, updated and not yet updated layers differ.
        """
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx must be an int in [0, {len(self.layers)}), got {layer_idx!r}")
        layer = self.layers[layer_idx]
        if positions is None:
            positions = layer.lengths[:, None] + jnp.arange(keys.shape[2], dtype=jnp.int32)[None, :]
        layer, view = layer.update(keys, values, positions)
        layers = self.layers[:layer_idx] + (layer,) + self.layers[layer_idx + 1 :]
        return self.replace(layers=layers), view

    # --- lengths, capacity, footprint --------------------------------------------
    @property
    def lengths(self) -> jax.Array:
        """``[B]`` int32: tokens each row has seen (absolute count, not stored slots)."""
        return self.layers[0].lengths

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def next_positions(self, num_tokens: int, num_new=None) -> jax.Array:
        """``[B, T]`` positions for T new tokens per row; with ``num_new`` ``[B]``, row b's
        tokens past ``num_new[b]`` are padding (-1): ragged prefill of right-padded prompts."""
        positions = self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
        if num_new is None:
            return positions
        real = jnp.arange(num_tokens)[None, :] < jnp.asarray(num_new, jnp.int32)[:, None]
        return jnp.where(real, positions, -1)

    @property
    def max_length(self) -> int | None:
        """Longest sequence every layer can hold (None: unbounded or growing)."""
        bounds = [layer.max_length for layer in self.layers if layer.max_length is not None]
        return min(bounds) if bounds else None

    @property
    def max_rollback(self) -> int | None:
        """Most tokens ``rollback`` may undo in every layer (None: unbounded)."""
        budgets = [layer.max_rollback for layer in self.layers if layer.max_rollback is not None]
        return min(budgets) if budgets else None

    @property
    def overflowed(self) -> jax.Array:
        """``[B]`` bool: rows some layer could not store (only possible under jit)."""
        flags = jnp.stack([layer.overflowed for layer in self.layers])
        return jnp.any(flags, axis=0)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def reserve(self, num_new_tokens: int) -> Cache:
        """Grow growing layers (outside jit) so each row can take ``num_new_tokens`` more."""
        return self.replace(
            layers=tuple(layer.reserve(num_new_tokens) if hasattr(layer, "reserve") else layer for layer in self.layers)
        )

    # --- batch and time edits -----------------------------------------------------
    def reorder(self, beam_indices) -> Cache:
        """Row i of the result is row ``beam_indices[i]`` of this cache, in every leaf."""
        indices = jnp.asarray(beam_indices, jnp.int32)
        if indices.ndim != 1:
            raise ValueError(f"reorder/select take a [B'] index vector, got shape {indices.shape}")
        if not is_traced(indices) and indices.size and (indices.min() < 0 or indices.max() >= self.batch_size):
            raise IndexError(f"row indices {np.asarray(indices).tolist()} out of range for batch {self.batch_size}")
        return self.replace(layers=tuple(layer.gather_rows(indices) for layer in self.layers))

    select = reorder

    def repeat(self, num_repeats: int) -> Cache:
        """Each row ``num_repeats`` times in a row (one prefilled prompt -> N beams/samples)."""
        if num_repeats <= 0:
            raise ValueError(f"num_repeats must be positive, got {num_repeats}")
        return self.reorder(jnp.repeat(jnp.arange(self.batch_size), num_repeats))

    def rollback(self, num_tokens) -> Cache:
        """Forget the last ``num_tokens`` (int or ``[B]``) of each row in every layer.

        Eagerly, more than ``max_rollback`` is an error. Under jit the count is clamped to
        ``max_rollback`` (and to each row's length) so all layers stay in step; feed the
        tokens again at the positions ``next_positions`` gives.
        """
        n = jnp.asarray(num_tokens, jnp.int32)
        budget = self.max_rollback
        if budget is not None and is_traced(n):
            n = jnp.minimum(n, budget)
        return self.replace(layers=tuple(layer.rollback(n) for layer in self.layers))

    def reset(self) -> Cache:
        """Empty every layer, keeping shapes (and so the compiled steps)."""
        return self.replace(layers=tuple(layer.reset() for layer in self.layers))

    # --- display ------------------------------------------------------------------
    def __repr__(self) -> str:
        lengths = "traced" if is_traced(self.lengths) else np.asarray(self.lengths).tolist()
        rows = [f"Cache(batch={self.batch_size}, layers={len(self.layers)}, lengths={lengths}, {_human(self.nbytes)})"]
        for i, (kind, layer) in enumerate(zip(self.layer_types, self.layers)):
            leaf = jax.tree.leaves(layer)[0]
            rows.append(
                f"  {i:>3} {kind:<18} {type(layer).__name__:<19} {_layer_detail(layer):<14} "
                f"{str(list(leaf.shape)):<18} {str(leaf.dtype):<9} {_human(layer.nbytes):>10}"
            )
        return "\n".join(rows)


def _layer_detail(layer) -> str:
    parts = [f"{name}={getattr(layer, name)}" for name in ("window", "chunk") if hasattr(layer, name)]
    if getattr(layer, "rollback_slots", 0):
        parts.append(f"R={layer.rollback_slots}")
    return " ".join(parts) or "-"


def _human(num_bytes: float) -> str:
    if num_bytes < 1024:
        return f"{num_bytes:.0f} B"
    for unit in ("KiB", "MiB"):
        num_bytes /= 1024
        if num_bytes < 1024:
            return f"{num_bytes:.1f} {unit}"
    return f"{num_bytes / 1024:.2f} GiB"
