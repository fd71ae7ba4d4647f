"""The container: one cache layer per model layer, chosen from the config's ``layer_types``.

``Cache`` only routes: the core of ``jaxkv.protocol`` to every layer, a capability's methods
to the layers that have it (an operation that needs it of every layer names the one lacking
it). Model code calls one line per attention layer:

    cache, out = cached_attention(cache, layer_idx, q, k, v, positions)   # jaxkv.attention

(``Cache.attend``: the layer stores K/V and attention reads what it returned;
``cache.update`` alone returns that view) and never sees how a layer stores its K/V.
Every operation returns a new ``Cache``; the old one is untouched, so a prefilled prefix can
seed many continuations without a copy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.batch import PackedAttention, PackedBatch, PackedState, PagedStorage
from jaxkv.eviction import EvictionSpec
from jaxkv.kernels import XLA, resolve_backend
from jaxkv.layers.dynamic import DynamicLayer
from jaxkv.layers.evicting import EvictingLayer, PackedEvictingLayer
from jaxkv.layers.indexed import DynamicIndexedLayer, IndexedLayer, PagedIndexedLayer
from jaxkv.layers.latent import DynamicLatentLayer, LatentLayer, PagedLatentLayer, QuantizedLatentLayer
from jaxkv.layers.linear import HybridLayer, LinearAttentionLayer, PackedStateLayer
from jaxkv.layers.paged import PagedLayer, Paging
from jaxkv.layers.quantized import QuantizedLayer
from jaxkv.layers.retrieval import RETRIEVAL_LAYERS, RetrievalLayer
from jaxkv.retrieval import RetrievalSpec
from jaxkv.layers.static import StaticLayer
from jaxkv.layers.windowed import ChunkedLayer, SlidingWindowLayer
from jaxkv.offload import (
    ALL, Prefetch, fetch, kv_leaves, map_entries, moved, offloaded_groups, offloaded_layers, on_host, store,
)  # fmt: skip
from jaxkv.protocol import (
    CacheLayer,
    ChunkLimit,
    Eviction,
    Growth,
    HostMemory,
    KVView,
    LinearState,
    Overflow,
    Rollback,
    RowSelection,
    entry,
    has,
    is_traced,
    limit_rollback,
    missing,
    pytree_class,
    require,
    stacked_for_layers,
)
from jaxkv.mla import LatentSpec
from jaxkv.quantization import QuantSpec
from jaxkv.sharding import Layout, constrain, device_bytes, to_host, with_layers
from jaxkv.sizing import bucket, human_bytes


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Everything a layer builder may need (``Cache.from_layer_types`` builds every layer from
    one); each builder checks the fields it uses. Options that concern every layer are checked
    here, ``dtype`` and ``state_shapes`` normalized.

    ``full_attention``: 'static' (preallocated ``max_length``) or 'dynamic' (grows).
    ``rollback_slots``: extra ring slots, so windowed layers can undo that many tokens plus one
    (a bare ring already allows one); linear-attention layers keep the states of that many past
    tokens and undo exactly that many.
    ``conv_width``, ``conv_channels``, ``state_shapes``: the linear-attention state (conv of
    width K over C channels, recurrent states of per-row shapes), for the ``linear_attention``,
    ``conv`` and ``hybrid*`` layer types.
    ``quantization``: a ``QuantSpec`` stores full (static) and sliding attention layers as
    ``QuantizedLayer`` (int8/4/2 or fp8 codes, group scales, a residual).
    ``paging``: a ``Paging`` stores full and sliding attention layers as ``PagedLayer`` (page
    pools read through block tables; ``batch_size`` is then the block table's rows), quantized
    pages with ``quantization`` too.
    ``eviction``: an ``EvictionSpec`` keeps full-attention layers in a budget of slots, evicting
    by its policy (``EvictingLayer``; models attend through ``cached_attention``); a compression
    ratio of 0 builds the uncompressed layers. With ``paging`` (the serving engine) they are
    ``PackedEvictingLayer``: a budget of slots per engine row, no pages.
    ``retrieval``: a ``RetrievalSpec`` keeps every token of full-attention layers (static,
    ``max_length``) and has each query read a budget of pages (``RetrievalLayer``); the other
    layer types (Gemma 3's sliding rings) are unchanged.
    ``latent``: a ``LatentSpec``, what ``latent_attention`` (MLA) and ``indexed_attention`` (DSA)
    layers store per token (``jaxkv.layers.latent``, ``jaxkv.layers.indexed``), static or dynamic.
    ``attention_backend``: what reads the decode tokens of static full-attention layers
    (``jaxkv.kernels``: 'xla', 'pallas_gpu', 'pallas_tpu', 'auto'; docs/kernels.md); the other
    layers are read by XLA, paged ones by ``paging.attention_backend``.
    """

    batch_size: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = jnp.float32
    max_length: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    full_attention: str = "static"
    rollback_slots: int = 0
    # Linear-attention state: conv width K, conv channels C, per-row recurrent state shapes.
    conv_width: int | None = None
    conv_channels: int | None = None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    # Store full and sliding attention K/V quantized (jaxkv.layers.quantized); None: the cache dtype.
    quantization: QuantSpec | None = None
    # Store full and sliding attention K/V in page pools read through block tables (jaxkv.layers.paged).
    paging: Paging | None = None
    # Keep full-attention K/V in a budget of slots, evicting by a policy (jaxkv.layers.evicting).
    eviction: EvictionSpec | None = None
    # Keep every full-attention token; each query reads a budget of pages (jaxkv.layers.retrieval).
    retrieval: RetrievalSpec | None = None
    # MLA's latent (and DSA's indexer) per token, for latent_attention and indexed_attention (jaxkv.mla).
    latent: LatentSpec | None = None
    num_layers: int = 1  # the model's layers (PyramidKV spreads its budget over them)
    # What reads static full-attention layers' queries (jaxkv.kernels; resolved: not 'auto'), and
    # the mesh and rules the cache is sharded by, over which those kernels run per device.
    attention_backend: str = XLA
    sharding: Layout | None = None

    def __post_init__(self):
        if self.full_attention not in FULL_ATTENTION_KINDS:
            raise ValueError(f"full_attention must be one of {FULL_ATTENTION_KINDS}, got {self.full_attention!r}")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        # A frozen dataclass normalizes its own fields through object.__setattr__.
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "state_shapes", tuple(tuple(shape) for shape in self.state_shapes))
        if self.eviction is not None and self.eviction.is_uncompressed():
            object.__setattr__(self, "eviction", None)  # a ratio of 0 evicts nothing: the plain layers


def _paged_layer(spec: LayerSpec, window: int | None = None) -> CacheLayer:
    return PagedLayer.create(spec.num_kv_heads, spec.head_dim, spec.paging, spec.dtype, window, spec.quantization)


def _quantized_layer(spec: LayerSpec, **extent) -> CacheLayer:
    return QuantizedLayer.create(
        spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.quantization, spec.dtype, **extent
    )


def _evicting_layer(spec: LayerSpec) -> CacheLayer:
    if spec.quantization is not None:
        raise ValueError("eviction keeps full-precision K/V in its own slots; it does not combine with quantization")
    # Under paging (the serving engine) a compression ratio is a fraction of the longest sequence.
    eviction = spec.eviction.resolved(spec.paging.max_length if spec.paging else spec.max_length)
    slots = max(eviction.layer_budgets(spec.num_layers))  # PyramidKV's first layer keeps the most
    layer = EvictingLayer.create(spec.batch_size, spec.num_kv_heads, spec.head_dim, eviction, slots, spec.dtype)
    if spec.paging is None:
        return layer
    return PackedEvictingLayer(layer)


def _full_attention_layer(spec: LayerSpec) -> CacheLayer:
    layer = _full_attention_storage(spec)
    if spec.full_attention == "dynamic":
        require(layer, Growth, "full_attention='dynamic' asks for one; with eviction or paging leave it 'static'")
    return layer


def _retrieval_layer(spec: LayerSpec) -> CacheLayer:
    others = {"quantization": spec.quantization, "paging": spec.paging, "eviction": spec.eviction}
    given = [name for name, value in others.items() if value is not None]
    if given or spec.full_attention != "static" or spec.max_length is None:
        raise ValueError(
            f"retrieval keeps every token in a preallocated full-precision buffer: pass max_length, "
            f"full_attention='static' and no {' or '.join(given) or 'quantization, paging or eviction'}"
        )
    return RETRIEVAL_LAYERS[spec.retrieval.pages].create(
        spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.max_length, spec.retrieval, spec.dtype
    )


def _full_attention_storage(spec: LayerSpec) -> CacheLayer:
    if spec.retrieval is not None:
        return _retrieval_layer(spec)
    if spec.eviction is not None:
        return _evicting_layer(spec)
    if spec.paging is not None:
        return _paged_layer(spec)
    if spec.quantization is not None:
        if spec.full_attention != "static" or spec.max_length is None:
            raise ValueError(
                "a quantized full-attention cache is preallocated: use full_attention='static' and pass max_length"
            )
        return _quantized_layer(spec, max_length=spec.max_length)
    if spec.full_attention == "dynamic":
        return DynamicLayer.create(spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.dtype)
    if spec.max_length is None:
        raise ValueError("a static full-attention cache needs max_length; pass it, or use full_attention='dynamic'")
    return StaticLayer.create(
        spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.max_length, spec.dtype, spec.attention_backend,
        spec.sharding,
    )


def _sliding_layer(spec: LayerSpec) -> CacheLayer:
    if not spec.sliding_window:
        raise ValueError("layer type 'sliding_attention' needs the config's sliding_window (a positive int)")
    if spec.paging is not None:
        return _paged_layer(spec, spec.sliding_window)
    if spec.quantization is not None:
        return _quantized_layer(spec, window=spec.sliding_window, rollback_slots=spec.rollback_slots)
    return SlidingWindowLayer.create(
        spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.sliding_window, spec.dtype, spec.rollback_slots
    )


def _chunked_layer(spec: LayerSpec) -> CacheLayer:
    if not spec.attention_chunk_size:
        raise ValueError("layer type 'chunked_attention' needs the config's attention_chunk_size (a positive int)")
    if spec.paging is not None:
        raise ValueError("paging covers full and sliding attention; chunked_attention layers are not paged")
    if spec.quantization is not None:
        raise ValueError(
            "quantization covers full and sliding attention; chunked_attention layers are not quantized yet"
        )
    return ChunkedLayer.create(
        spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.attention_chunk_size, spec.dtype, spec.rollback_slots
    )


def _latent_storage(spec: LayerSpec, static, dynamic, paged) -> CacheLayer:
    """A latent layer: ``static`` or ``dynamic`` by ``full_attention``; under ``paging`` (the engine)
    ``paged``, in pages of the full-attention pool."""
    if spec.latent is None:
        raise ValueError(
            "layer types 'latent_attention' and 'indexed_attention' need latent=LatentSpec(...) (from_config reads "
            "kv_lora_rank, qk_rope_head_dim, index_head_dim and index_topk)"
        )
    if spec.eviction is not None:
        raise ValueError("latent and indexed attention layers keep every token; not with eviction")
    if spec.quantization is not None:
        return _quantized_latent(spec, static)
    if spec.paging is not None:
        return paged.create(spec.latent, spec.paging, spec.dtype)
    if spec.full_attention == "dynamic":
        return dynamic.create(spec.batch_size, spec.latent, spec.dtype)
    if spec.max_length is None:
        raise ValueError("a static latent cache needs max_length; pass it, or use full_attention='dynamic'")
    return static.create(spec.batch_size, spec.latent, spec.max_length, spec.dtype)


def _quantized_latent(spec: LayerSpec, static) -> CacheLayer:
    """``QuantizedLatentLayer``: a static ``latent_attention`` layer (not DSA's, not paged or dynamic)."""
    if static is not LatentLayer or spec.paging is not None or spec.full_attention == "dynamic":
        raise ValueError(
            "quantization covers static latent_attention layers (QuantizedLatentLayer); indexed, paged and dynamic "
            "latent layers are stored at the cache dtype"
        )
    if spec.max_length is None:
        raise ValueError("a quantized latent cache needs max_length")
    return QuantizedLatentLayer.create(
        spec.batch_size, spec.latent, spec.max_length, spec.dtype, quantization=spec.quantization
    )


def _latent_layer(spec: LayerSpec) -> CacheLayer:
    return _latent_storage(spec, LatentLayer, DynamicLatentLayer, PagedLatentLayer)


def _indexed_layer(spec: LayerSpec) -> CacheLayer:
    return _latent_storage(spec, IndexedLayer, DynamicIndexedLayer, PagedIndexedLayer)


def _conv_state(spec: LayerSpec, state_shapes) -> CacheLayer:
    if not spec.conv_width or not spec.conv_channels:
        raise ValueError(
            "linear-attention and conv layer types need conv_width and conv_channels (and state_shapes for a "
            "recurrent state): pass them to Cache.from_layer_types, or give from_config a config with "
            "linear_conv_kernel_dim and the linear_* head sizes"
        )
    layer = LinearAttentionLayer.create(
        spec.batch_size, spec.conv_channels, spec.conv_width, state_shapes, spec.dtype, spec.rollback_slots
    )
    if spec.paging is None:
        return layer
    return PackedStateLayer(layer)


def _linear_layer(spec: LayerSpec) -> CacheLayer:
    if not spec.state_shapes:
        raise ValueError("layer type 'linear_attention' needs state_shapes (use 'conv' for a conv-only layer)")
    return _conv_state(spec, spec.state_shapes)


def _conv_layer(spec: LayerSpec) -> CacheLayer:
    return _conv_state(spec, ())


def _check_hybrid_options(spec: LayerSpec) -> None:
    if spec.paging is not None:
        raise ValueError(
            "paging keeps linear-attention states in their own layers (linear_attention, conv); a hybrid layer "
            "(hybrid, hybrid_sliding) is not paged"
        )
    if spec.eviction is not None:
        raise ValueError(
            "eviction covers full_attention layers; a hybrid layer (hybrid, hybrid_sliding) keeps all its K/V"
        )
    if spec.retrieval is not None:
        raise ValueError("retrieval covers full_attention layers; a hybrid layer (hybrid, hybrid_sliding) reads all")


def _hybrid_layer(spec: LayerSpec) -> CacheLayer:
    _check_hybrid_options(spec)
    return HybridLayer(_linear_layer(spec), _full_attention_layer(spec))


def _hybrid_sliding_layer(spec: LayerSpec) -> CacheLayer:
    _check_hybrid_options(spec)
    return HybridLayer(_linear_layer(spec), _sliding_layer(spec))


@dataclasses.dataclass(frozen=True)
class LayerType:
    """What a ``layer_types`` name means: how to build its layer, and the classes that store it,
    each with its ``MEMORY_FORMULA`` and ``kv_bytes`` (``jaxkv.memory`` reads them from here).

    ``storage``: the class per full-attention kind ('static', 'dynamic'), or under None for a
    type with one storage; empty for a type made of others (a hybrid holds a linear state and
    an attention layer). ``quantized``: the class that stores it under ``quantization``, if any;
    ``paged``: under ``paging``; ``evicted``: under ``eviction``; ``retrieved``: under ``retrieval``.
    """

    build: Callable[[LayerSpec], CacheLayer]
    storage: Mapping[str | None, type[CacheLayer]]
    quantized: type[CacheLayer] | None = None
    paged: type[CacheLayer] | None = None
    evicted: type[CacheLayer] | None = None
    retrieved: type[CacheLayer] | None = None


# The config's layer_types value -> its builder and storage. A new layer family registers
# here; the container, the memory formulas and the README's table follow.
LAYER_TYPES: dict[str, LayerType] = {
    "full_attention": LayerType(
        _full_attention_layer,
        {"static": StaticLayer, "dynamic": DynamicLayer},
        quantized=QuantizedLayer,
        paged=PagedLayer,
        evicted=EvictingLayer,
        retrieved=RetrievalLayer,
    ),
    "sliding_attention": LayerType(
        _sliding_layer, {None: SlidingWindowLayer}, quantized=QuantizedLayer, paged=PagedLayer
    ),
    "chunked_attention": LayerType(_chunked_layer, {None: ChunkedLayer}),
    "linear_attention": LayerType(_linear_layer, {None: LinearAttentionLayer}, paged=PackedStateLayer),
    "conv": LayerType(_conv_layer, {None: LinearAttentionLayer}, paged=PackedStateLayer),
    "hybrid": LayerType(_hybrid_layer, {}),
    "hybrid_sliding": LayerType(_hybrid_sliding_layer, {}),
    "latent_attention": LayerType(
        _latent_layer, {"static": LatentLayer, "dynamic": DynamicLatentLayer}, quantized=QuantizedLatentLayer,
        paged=PagedLatentLayer,
    ),
    "indexed_attention": LayerType(
        _indexed_layer, {"static": IndexedLayer, "dynamic": DynamicIndexedLayer}, paged=PagedIndexedLayer
    ),
}
FULL_ATTENTION_KINDS = tuple(LAYER_TYPES["full_attention"].storage)


class LayerBuilder(Protocol):
    """Builds a cache's layers in place of ``LAYER_TYPES``' builders (``Cache.from_layer_types``'
    ``layer_builder``): for caches whose layers do what no registered type does, such as the
    research package's, which record the attention each token receives."""

    def build(self, layer_type: str, spec: LayerSpec) -> CacheLayer:
        """The single layer of ``layer_type`` (a key of ``LAYER_TYPES``) for ``spec``; a type it
        leaves as it is: ``LAYER_TYPES[layer_type].build(spec)``."""


def _config_value(config, key, default=None):
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _linear_state_of(config) -> dict:
    """Conv width, channels and state shape of a gated-DeltaNet config (Qwen3-Next,
    Qwen3.5: ``linear_conv_kernel_dim``, ``linear_num_key_heads``, ...); empty otherwise.
    The conv runs over q, k and v; the state is ``[H_v, D_k, D_v]``."""
    width = _config_value(config, "linear_conv_kernel_dim")
    if width is None:
        return {}
    key_heads = _config_value(config, "linear_num_key_heads")
    value_heads = _config_value(config, "linear_num_value_heads")
    key_dim, value_dim = _config_value(config, "linear_key_head_dim"), _config_value(config, "linear_value_head_dim")
    return {
        "conv_width": width,
        "conv_channels": 2 * key_heads * key_dim + value_heads * value_dim,
        "state_shapes": ((value_heads, key_dim, value_dim),),
    }


def _latent_of(config) -> dict:
    """An MLA config's ``latent`` (``kv_lora_rank``, ``qk_rope_head_dim``, and DSA's ``index_head_dim``,
    ``index_topk``: DeepSeek-V3.2); empty otherwise."""
    rank = _config_value(config, "kv_lora_rank")
    if rank is None:
        return {}
    index = {"index_dim": _config_value(config, "index_head_dim"), "index_topk": _config_value(config, "index_topk")}
    return {"latent": LatentSpec(rank, _config_value(config, "qk_rope_head_dim"), **index)}


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


def pattern_period(layer_types: Sequence[str]) -> int:
    """Length of the shortest prefix whose repetition gives ``layer_types`` (Gemma 3: 6)."""
    n = len(layer_types)
    return next(p for p in range(1, n + 1) if all(layer_types[i] == layer_types[i % p] for i in range(n)))


KV_SHARING_MODES = (None, "store", "reuse")


def kv_sources_of(config, layer_types: Sequence[str]) -> tuple[int, ...]:
    """Per model layer, the layer whose K/V it attends over: its own index, or for a layer that
    reuses another's K/V (Gemma 4, Gemma 3n), the last earlier layer of its type that stores its
    own; empty when every layer stores its own. Read from the config's ``kv_sharing_modes``
    (transformers': per layer None, 'store' or 'reuse'), else from ``num_kv_shared_layers`` as
    transformers derives those modes (the last ``num_kv_shared_layers`` layers reuse)."""
    modes = _config_value(config, "kv_sharing_modes")
    if modes is None:
        shared = _config_value(config, "num_kv_shared_layers") or 0
        modes = [None] * (len(layer_types) - shared) + ["reuse"] * shared
    if len(modes) != len(layer_types) or set(modes) - set(KV_SHARING_MODES):
        raise ValueError(
            f"kv_sharing_modes must give one of {KV_SHARING_MODES} per layer ({len(layer_types)} layers), got {modes}"
        )
    if "reuse" not in modes:
        return ()
    sources = []
    for i, (kind, mode) in enumerate(zip(layer_types, modes)):
        storing = [j for j in range(i + 1) if modes[j] != "reuse" and layer_types[j] == kind]
        if not storing:
            raise ValueError(f"layer {i} ({kind}) reuses K/V, but no earlier {kind} layer stores any")
        sources.append(i if mode != "reuse" else storing[-1])
    return tuple(sources)


# The layer types whose K/V a later layer may reuse (a state, a latent or an index is not shared).
SHAREABLE_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def check_kv_sources(kv_sources: Sequence[int], layer_types: Sequence[str]) -> None:
    """``kv_sources`` (``Cache.from_layer_types``): empty, or per layer its own index or an earlier
    layer of the same type (one of ``SHAREABLE_TYPES``) that stores its own K/V."""
    if not kv_sources:
        return
    if len(kv_sources) != len(layer_types):
        raise ValueError(f"kv_sources lists {len(kv_sources)} layers but layer_types {len(layer_types)}")
    for i, source in enumerate(kv_sources):
        if not 0 <= source <= i or kv_sources[source] != source or layer_types[source] != layer_types[i]:
            raise ValueError(
                f"kv_sources[{i}] = {source}: a layer reads its own K/V or those of an earlier layer of its type "
                f"({layer_types[i]}) that stores its own"
            )
        if source != i and layer_types[i] not in SHAREABLE_TYPES:
            raise ValueError(
                f"kv_sources[{i}] = {source}: layers of type {layer_types[i]} store their own (K/V of "
                f"{', '.join(SHAREABLE_TYPES)} layers can be shared)"
            )


def kv_shapes_of(config, layer_types: Sequence[str], num_kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """Per layer type, ``(num_kv_heads, head_dim)`` where the config's ``per_layer_config``
    (transformers' per-layer overrides, by layer index: Gemma 4's full-attention layers have a head
    dim of their own) makes them differ from ``num_kv_heads``, ``head_dim``; the layers of one type
    must agree."""
    per_layer = _config_value(config, "per_layer_config")
    if per_layer is None:
        return {}
    shapes = {}
    for i, kind in enumerate(layer_types):
        # A mapping by layer index (as config.json writes it), or transformers' view of per-layer configs.
        layer = per_layer.get(i, per_layer.get(str(i), {})) if isinstance(per_layer, Mapping) else per_layer[i]
        shape = (
            _config_value(layer, "num_key_value_heads") or num_kv_heads, _config_value(layer, "head_dim") or head_dim
        )
        if shapes.setdefault(kind, shape) != shape:
            raise ValueError(
                f"per_layer_config gives {kind} layers different (num_key_value_heads, head_dim): {shapes[kind]} and "
                f"{shape} (layer {i}); a cache stores every layer of a type alike"
            )
    return {kind: shape for kind, shape in shapes.items() if shape != (num_kv_heads, head_dim)}


def stack_layers(layers: Sequence[CacheLayer]) -> CacheLayer:
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)


def check_layer_types(layer_types: Sequence[str]) -> None:
    if not layer_types:
        raise ValueError("layer_types is empty: a cache needs at least one layer")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"unknown layer type(s) {unknown}; known layer types: {sorted(LAYER_TYPES)}")


def build_groups(
    layer_types: Sequence[str],
    spec: LayerSpec,
    period: int,
    layer_builder: LayerBuilder | None = None,
    stored: Sequence[int] | None = None,
    kv_shapes: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[CacheLayer, ...]:
    """Group g: the type of stored layer g (``stored``: the model layers that store K/V, in order;
    default every one) built once (by ``layer_builder``, else its ``LAYER_TYPES`` builder) and
    repeated for stored layers g, g + period, ... ``kv_shapes``: per layer type, its
    ``(num_kv_heads, head_dim)`` where it differs from ``spec``'s."""
    stored = range(len(layer_types)) if stored is None else stored
    groups = []
    for g in range(period):
        indices = list(stored[g::period])
        kind = layer_types[indices[0]]
        heads, dim = (kv_shapes or {}).get(kind, (spec.num_kv_heads, spec.head_dim))
        kind_spec = dataclasses.replace(spec, num_kv_heads=heads, head_dim=dim)
        layer = LAYER_TYPES[kind].build(kind_spec) if layer_builder is None else layer_builder.build(kind, kind_spec)
        groups.append(stacked_for_layers(layer, indices, len(layer_types)))
    return tuple(groups)


def concrete_index(index) -> int | None:
    """A layer index as an int when it is concrete (a Python or NumPy integer, or a 0-d JAX
    integer array outside a trace); None when it is traced."""
    if isinstance(index, jax.core.Tracer):
        return None
    value = np.asarray(index)
    if value.ndim != 0 or not np.issubdtype(value.dtype, np.integer):
        raise TypeError(f"a layer index must be an integer scalar, got {value.dtype} of shape {value.shape}")
    return int(value)


def first_entry_shapes(group: CacheLayer) -> CacheLayer:
    """The group's first layer with shapes only (for shape-derived properties, no compute)."""
    return jax.eval_shape(lambda g: jax.tree.map(lambda leaf: leaf[0], g), group)


_PAGED_FIX = "build the cache with paging= (the serving engine's layers)"


def _layer_spec(spec: LayerSpec | None, fields: dict, num_layers: int) -> LayerSpec:
    """``spec``, or the ``LayerSpec`` of ``fields``, for ``num_layers`` layers, its attention
    backend resolved (``'auto'``: the platform's kernel)."""
    if spec is not None and fields:
        raise TypeError(
            f"from_layer_types: pass spec=LayerSpec(...) or its fields as keywords, not both (got {sorted(fields)})"
        )
    spec = spec or LayerSpec(**fields)
    return dataclasses.replace(spec, num_layers=num_layers, attention_backend=resolve_backend(spec.attention_backend))


def _check_offload(spec: LayerSpec, mesh, kv_sources: Sequence[int]) -> None:
    """``offload`` covers a one-device cache of plain, quantized or retrieval layers, each storing its own K/V."""
    other = {"paging": spec.paging, "eviction": spec.eviction, "mesh": mesh, "kv_sources": kv_sources or None}
    given = [name for name, value in other.items() if value is not None]
    if given:
        raise ValueError(
            f"offload keeps whole layers' K/V in host memory on one device; it does not combine with {given[0]}"
        )


def _recording(read: Callable) -> tuple[Callable, list]:
    """``read`` (``CacheLayer.attend_entry``'s) and a list that receives the view each call reads,
    as the call is traced: the view a layer's update returned, kept for the layers that reuse it."""
    views = []

    def recorded(queries, view, positions, query_weights):
        views.append(view)
        return read(queries, view, positions, query_weights)

    return recorded, views


def _replaced(items: tuple, i: int, item) -> tuple:
    """``items`` with entry ``i`` replaced by ``item``."""
    return items[:i] + (item,) + items[i + 1 :]


def _in_host_memory(stack: CacheLayer) -> CacheLayer:
    """An offloaded group's stack with its host leaves (``_host_leaves``) moved there."""
    if has(stack, HostMemory):
        return stack.in_host_memory()
    return moved(stack, _host_leaves(stack), jax.memory.Space.Host)


def _shapes(tree) -> list[tuple[int, ...]]:
    return [leaf.shape for leaf in jax.tree.leaves(tree)]


def _host_leaves(stack: CacheLayer) -> CacheLayer:
    """Per leaf of a group: whether an offloaded group keeps it on the host (its K/V, or what a
    ``HostMemory`` layer says)."""
    if has(stack, HostMemory):
        return stack.host_leaves()
    return kv_leaves(first_entry_shapes(stack).logical_axes())


@pytree_class
class Cache:
    """One cache layer per model layer, stored as stacks of same-kind layers.

    Layer i lives in group ``i % period`` at index ``i // period``, where ``period`` is
    the length of the repeating pattern of ``layer_types`` (1 for Llama, 6 for Gemma 3's
    5 sliding : 1 global). A model can then ``lax.scan`` over repeats of its pattern with
    the cache in the carry, and each ``update`` writes its layer's entry of the stack in
    place. All layers see the same tokens, so they agree on ``lengths``. Every method is
    pure and jittable except ``reserve`` (it reads lengths to pick a shape).

    K/V shared across layers (``kv_sources``; Gemma 4): a layer that reuses another's K/V holds
    no storage; the groups stack the storing layers only (``stored_layers``; the pattern is theirs),
    so every rollback, reorder and byte count covers each shared cache once. In a forward the
    storing layer's ``attend`` keeps the view its update returned (``shared_views``) and the
    reusing layers attend over it: exactly the K/V the storing layer's own queries saw.
    """

    groups: tuple  # group g: a layer whose every leaf has a leading axis over its layers
    layer_types: tuple[str, ...] = struct.field(pytree_node=False)
    period: int = struct.field(pytree_node=False)
    # The mesh and rules the cache is sharded by (None: one device). Every update and edit
    # constrains its result to them, so compiled loops keep each leaf where it was allocated.
    layout: Layout | None = struct.field(pytree_node=False, default=None)
    # The groups whose K/V lives in host memory (``jaxkv.offload``), and inside a forward, per
    # group, the device copy of the entry its next update reads (``with_prefetch``; else empty).
    offloaded: tuple[int, ...] = struct.field(pytree_node=False, default=())
    prefetched: tuple = ()
    # Per model layer, the layer whose K/V it attends over (``kv_sources_of``); empty: each its own.
    kv_sources: tuple[int, ...] = struct.field(pytree_node=False, default=())
    # Inside a forward, by storing model layer, the view its update returned, for the layers that
    # reuse its K/V (``attend``); empty outside a forward (``without_prefetch`` drops them).
    shared_views: dict = struct.field(default_factory=dict)

    # --- construction -------------------------------------------------------------
    @classmethod
    def from_layer_types(
        cls,
        layer_types: Sequence[str],
        spec: LayerSpec | None = None,
        *,
        stacked: bool = False,
        layer_builder: LayerBuilder | None = None,
        mesh: jax.sharding.Mesh | None = None,
        rules: Mapping[str, str | None] | None = None,
        offload=None,
        kv_sources: Sequence[int] = (),
        kv_shapes: Mapping[str, tuple[int, int]] | None = None,
        **fields,
    ) -> Cache:
        """One layer per entry of ``layer_types`` (keys of ``LAYER_TYPES``), each built from
        ``spec`` (a ``LayerSpec``: sizes, dtype, storage options; what each field sets is said
        there), or from ``LayerSpec``'s fields given as keywords (``batch_size=2, ...``), not both.
        ``num_layers`` is ``len(layer_types)``.

        ``layer_builder``: builds every layer in place of ``LAYER_TYPES``' builders
        (``LayerBuilder``: ``layer_builder.build(layer_type, spec)``).
        ``stacked``: store the repeats of the layer pattern stacked (``period`` = pattern
        length), for models that scan over their layers. Unstacked (``period`` = number
        of layers), each layer is its own buffer, which unrolled models read without a
        copy; a stacked layer's K/V slice is copied when a dot reads it on CPU.
        ``mesh``, ``rules``: allocate the cache sharded over ``mesh`` (``jaxkv.sharding``: each
        leaf's logical axes mapped by ``DEFAULT_RULES`` updated with ``rules``), by a jitted
        zeros whose ``out_shardings`` put each device's share there directly.
        ``offload``: keep the K/V of these layers in host memory and bring one layer at a time to
        the device (``jaxkv.offload``): True (full-attention layers), ``"all"``, a layer type, or a
        list of layer types and indices; not with ``paging``, ``eviction`` or ``mesh``. A retrieval
        layer keeps its K/V there and brings only the pages a query reads (``HostMemory``).
        ``kv_sources``: per layer, the layer whose K/V it attends over (``kv_sources_of``): its own
        index, or an earlier storing layer of its type, whose K/V it reuses with no storage of its
        own; empty: every layer stores its own. ``kv_shapes``: per layer type, its
        ``(num_kv_heads, head_dim)`` where it differs from the spec's (``kv_shapes_of``).
        """
        spec = _layer_spec(spec, fields, len(layer_types))
        check_layer_types(layer_types)
        check_kv_sources(kv_sources, layer_types)
        if kv_sources and spec.eviction is not None:
            raise ValueError(
                "eviction scores each layer's slots by the attention they receive; it does not combine with K/V "
                "shared across layers (kv_sources)"
            )
        stored = tuple(i for i in range(len(layer_types)) if not kv_sources or kv_sources[i] == i)
        stored_types = [layer_types[i] for i in stored]
        period = pattern_period(stored_types) if stacked else len(stored_types)
        layout = None if mesh is None else Layout.create(mesh, rules)
        if layout is not None and spec.paging is not None:  # a kernel reading the pages is split by hand
            spec = dataclasses.replace(spec, paging=dataclasses.replace(spec.paging, sharding=layout))
        if layout is not None and spec.attention_backend != XLA:  # and so are the static layers' kernels
            spec = dataclasses.replace(spec, sharding=layout)

        def build() -> Cache:
            groups = build_groups(layer_types, spec, period, layer_builder, stored, kv_shapes)
            return cls(groups, tuple(layer_types), period, layout, kv_sources=tuple(kv_sources))

        offload_layers = offloaded_layers(offload, layer_types)
        if offload_layers:
            _check_offload(spec, mesh, kv_sources)
            groups = offloaded_groups(offload_layers, len(layer_types), period)
            return build()._with_host_groups(groups, every=isinstance(offload, str) and offload == ALL)
        if layout is None:
            return build()
        return jax.jit(build, out_shardings=jax.eval_shape(build).shardings())()

    @classmethod
    def from_config(cls, config, batch_size: int, **kwargs) -> Cache:
        """Build from a model config (dict or object with HF-style attribute names).

        Reads ``layer_types`` (or infers it), ``num_key_value_heads``, ``head_dim`` (or
        ``hidden_size // num_attention_heads``), ``sliding_window``,
        ``attention_chunk_size``, K/V shared across layers (``kv_sharing_modes`` or
        ``num_kv_shared_layers``: ``kv_sources_of``) and per-layer head shapes
        (``per_layer_config``: ``kv_shapes_of``). ``kwargs`` go to ``from_layer_types`` and take precedence
        over what the config says (e.g. a chunk size for a config that lists chunked layers
        without one).
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
        layer_types = layer_types_of(config)
        return cls.from_layer_types(
            layer_types,
            batch_size=batch_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            **{
                "kv_sources": kv_sources_of(config, layer_types),
                "kv_shapes": kv_shapes_of(config, layer_types, num_kv_heads, head_dim),
                "sliding_window": _config_value(config, "sliding_window"),
                "attention_chunk_size": _config_value(config, "attention_chunk_size"),
                **_linear_state_of(config),
                **_latent_of(config),
                **kwargs,
            },
        )

    # --- the one call model code makes -------------------------------------------
    def locate(self, layer_idx) -> tuple[int, Any]:
        """``(group, index in group)`` of a layer.

        ``layer_idx``: an integer (Python, NumPy, or a concrete 0-d JAX array), range-checked;
        a traced scalar when the pattern period is 1 (a scan over all layers); or
        ``(group, index)`` with a static group and an integer or traced index (a scan over
        repeats of the pattern, layer ``index * period + group``). Under K/V sharing a traced
        scalar and ``(group, index)`` count the storing layers only (``stored_layers``), and
        an integer naming a layer that reuses K/V locates the storing layer's.
        """
        if isinstance(layer_idx, tuple):
            return self.locate_in_group(*layer_idx)
        concrete = concrete_index(layer_idx)
        if concrete is not None:
            if not 0 <= concrete < len(self.layer_types):
                raise IndexError(f"layer_idx must be an int in [0, {len(self.layer_types)}), got {layer_idx}")
            slot = self.stored_layers.index(self.kv_source(concrete))
            return slot % self.period, slot // self.period
        if self.period != 1:
            raise TypeError(
                f"a traced layer_idx needs a cache whose layers all share one kind; this one repeats a pattern "
                f"of {self.period} layers: pass (group, index) with a static group"
            )
        return 0, layer_idx

    def locate_in_group(self, group, index) -> tuple[int, Any]:
        """``locate`` of ``(group, index)``: the group must be static, a concrete index in range."""
        static_group = concrete_index(group)
        if static_group is None:
            raise TypeError(
                "the group of a (group, index) layer_idx must be a static int; only the index may be traced"
            )
        if not 0 <= static_group < self.period:
            raise IndexError(f"group {group} out of range: this cache repeats a pattern of {self.period} layers")
        concrete = concrete_index(index)
        if concrete is None:
            return static_group, index
        count = jax.tree.leaves(self.groups[static_group])[0].shape[0]  # every leaf leads with the layer axis
        if not 0 <= concrete < count:
            raise IndexError(f"index {index} out of range: group {static_group} holds {count} layers")
        return static_group, concrete

    def update(self, layer_idx, keys, values, positions=None) -> tuple[Cache, KVView]:
        """Store new K/V ``[B, H_kv, T, D]`` of a layer; return what attention reads.

        ``layer_idx``: see ``locate``. ``positions`` ``[B, T]`` (negative = padding)
        default to the T positions after this layer's length. A model computes them once
        per forward (``next_positions``) before the first layer runs: mid-forward, updated
        and not yet updated layers differ.
        """
        self._check_stores(layer_idx, "update")
        group, index = self.locate(layer_idx)
        if positions is None:
            start = entry(self.groups[group].lengths, index)
            positions = start[:, None] + jnp.arange(keys.shape[2], dtype=jnp.int32)[None, :]
        cache, view = self._on_device(group, index, lambda stack, i: stack.update_entry(i, keys, values, positions))
        return cache._sharing(layer_idx, [view]), view

    def attend(
        self, layer_idx, queries, keys, values, positions, read: Callable, packed: PackedBatch | None = None
    ) -> tuple[Cache, jax.Array]:
        """Store K/V ``[B, H_kv, T, D]`` of a layer at ``positions`` ``[B, T]`` and attend ``queries``
        ``[B, H_q, T, D]`` with ``read`` (see ``CacheLayer.attend_entry``); returns the cache and the
        output. ``packed``: a serving step's packed batch (``[1, N]`` tokens of many rows), for the
        layers with the ``PackedAttention`` capability. Model code calls it through
        ``jaxkv.attention.cached_attention``.

        A layer that reuses another's K/V (``kv_sources``) takes ``keys = values = None`` and attends
        over the view the storing layer's update returned earlier in this forward."""
        source = self._reused_source(layer_idx)
        if source is not None:
            return self, self._attend_reused(layer_idx, source, queries, keys, values, positions, read)
        self._check_stores(layer_idx, "attend")
        read, views = _recording(read)
        group, index = self.locate(layer_idx)
        if packed is None:
            cache, out = self._on_device(
                group, index, lambda stack, i: stack.attend_entry(i, queries, keys, values, positions, read)
            )
            return cache._sharing(layer_idx, views), out
        stack = self.groups[group]
        require(stack, PackedAttention, _PAGED_FIX)
        stack, out = stack.attend_packed_entry(index, queries, keys, values, positions, read, packed)
        return self.with_group(group, stack)._sharing(layer_idx, views), out

    # --- K/V shared across layers -------------------------------------------------
    @property
    def stored_layers(self) -> tuple[int, ...]:
        """The model layers that store K/V, in order: every layer unless some reuse another's."""
        return tuple(i for i in range(len(self.layer_types)) if self.kv_source(i) == i)

    def kv_source(self, layer: int) -> int:
        """The model layer whose K/V layer ``layer`` (an int) attends over: itself, unless it reuses another's."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def _reused_source(self, layer_idx) -> int | None:
        """The storing layer a layer that reuses K/V reads (an integer ``layer_idx`` only: a traced
        one and ``(group, index)`` name storing layers); None for a layer that stores its own."""
        if not self.kv_sources or isinstance(layer_idx, tuple):
            return None
        concrete = concrete_index(layer_idx)
        if concrete is None or not 0 <= concrete < len(self.layer_types):
            return None  # locate says what is wrong
        return None if self.kv_source(concrete) == concrete else self.kv_source(concrete)

    def _readers(self, layer: int) -> list[int]:
        """The other model layers that reuse layer ``layer``'s K/V."""
        return [i for i in range(len(self.layer_types)) if i != layer and self.kv_source(i) == layer]

    def _check_stores(self, layer_idx, caller: str) -> None:
        """Errors for a write to a layer that holds no storage (it reuses another's K/V), and for a
        layer others read that is named by a traced or ``(group, index)`` index: its view must be
        kept under its model layer, known while tracing."""
        source = self._reused_source(layer_idx)
        if source is not None:
            raise ValueError(
                f"Cache.{caller}: layer {layer_idx} reuses layer {source}'s K/V and stores none; attend over them "
                f"with keys=None, values=None (cached_attention)"
            )
        if self.kv_sources and (isinstance(layer_idx, tuple) or concrete_index(layer_idx) is None):
            group, _ = self.locate(layer_idx)
            shared = [layer for layer in self.group_layers(group) if self._readers(layer)]
            if shared:
                raise TypeError(
                    f"Cache.{caller}: group {group} holds layer(s) {shared}, whose K/V other layers reuse: address "
                    f"them by their integer model layer index (a model unrolls them), not a traced one"
                )

    def _sharing(self, layer_idx, views: list) -> Cache:
        """This cache keeping the view layer ``layer_idx``'s update returned (``views``, the one
        recorded) when other layers reuse its K/V; unchanged otherwise."""
        if not self.kv_sources or isinstance(layer_idx, tuple) or concrete_index(layer_idx) is None:
            return self
        layer = concrete_index(layer_idx)
        if not self._readers(layer):
            return self
        return self.replace(shared_views={**self.shared_views, layer: views[0]})

    def _attend_reused(self, layer: int, source: int, queries, keys, values, positions, read: Callable) -> jax.Array:
        """Attention of ``queries`` of layer ``layer`` over the view storing layer ``source`` kept in this forward."""
        if keys is not None or values is not None:
            raise ValueError(
                f"Cache.attend: layer {layer} reuses layer {source}'s K/V and stores none: pass keys=None, values=None"
            )
        if source not in self.shared_views:
            raise ValueError(
                f"Cache.attend: layer {layer} reuses layer {source}'s K/V, which this forward has not computed: run "
                f"layer {source} first, in the same forward"
            )
        out, _ = read(queries, self.shared_views[source], positions, None)
        return out

    def update_state(
        self, layer_idx, conv_inputs, positions, conv_fn, step_fn, packed: PackedBatch | None = None
    ) -> tuple[Cache, Any]:
        """Feed a linear-attention (or hybrid) layer's conv inputs ``[B, T, C]`` at
        ``positions`` ``[B, T]``; return the cache and the layer's outputs. ``layer_idx``:
        see ``locate``; ``conv_fn``/``step_fn``: see ``jaxkv.layers.linear``; ``packed``: as in ``attend``."""
        group, index = self.locate(layer_idx)
        stack = self.groups[group]
        if packed is None:
            require(
                stack, LinearState, "update_state feeds linear-attention states (linear_attention, conv and hybrid "
                "layers); feed K/V with update (Cache.update)"
            )  # fmt: skip
            return self._on_device(
                group, index, lambda stack, i: stack.update_state_entry(i, conv_inputs, positions, conv_fn, step_fn)
            )
        require(stack, PackedState, _PAGED_FIX)
        stack, outputs = stack.update_state_packed_entry(index, conv_inputs, positions, conv_fn, step_fn, packed)
        return self.with_group(group, stack), outputs

    def _on_device(self, group: int, index, step: Callable) -> tuple[Cache, Any]:
        """``step(stack, index) -> (stack, result)`` on group ``group``. An offloaded group runs it
        on a one-entry window of entry ``index`` on the device. Outside a forward (no
        ``with_prefetch``) the window is fetched, updated and written back. Inside one it was
        fetched by the previous update, and while this layer computes, the previous update's
        entry goes back to the host stack and then entry ``index + 1`` is fetched (after the
        write, so that XLA updates the stack in place: a read of the stack before a write to it
        makes XLA copy the whole stack). The last update's fetch wraps to entry 0 and is dropped
        by ``without_prefetch``, which writes its entry back."""
        stack = self.groups[group]
        if group not in self.offloaded or has(stack, HostMemory):  # the latter reads its host memory itself
            stack, result = step(stack, index)
            return self.with_group(group, stack), result
        host = _host_leaves(stack)
        prefetch = self.prefetched[group] if self.prefetched else None
        if prefetch is None:
            window, result = step(fetch(stack, index, host), 0)
            return self.with_group(group, store(stack, index, window, host)), result
        stack = store(stack, prefetch.index, prefetch.written, host)
        following = fetch(stack, (index + 1) % len(self.group_layers(group)), host)
        window, result = step(prefetch.ready, 0)
        prefetch = Prefetch(following, window, jnp.asarray(index, jnp.int32))
        return self.with_group(group, stack).replace(prefetched=_replaced(self.prefetched, group, prefetch)), result

    def with_prefetch(self) -> Cache:
        """Before a forward that updates each group's layers in order from its first (a model's
        layer scan): entry 0 of every offloaded group of more than one layer fetched to the device,
        so that each update then fetches the next entry while its layer computes. A group of one
        layer is fetched when it is updated. Unchanged without offloaded groups."""
        if not self.offloaded:
            return self

        def first(group: int) -> Prefetch | None:
            stack = self.groups[group]
            if group not in self.offloaded or len(self.group_layers(group)) == 1 or has(stack, HostMemory):
                return None
            window = fetch(stack, 0, _host_leaves(stack))
            return Prefetch(window, window, jnp.int32(0))  # entry 0 "written back" unchanged by the first update

        return self.replace(prefetched=tuple(first(g) for g in range(self.period)))

    def without_prefetch(self) -> Cache:
        """After the forward: the last updated entry of each group written back, the prefetched ones
        dropped, and so are the views kept for layers that reuse K/V (``shared_views``)."""
        if self.shared_views:
            return self.replace(shared_views={}).without_prefetch()
        if not self.prefetched:
            return self
        groups = tuple(
            stack if prefetch is None else store(stack, prefetch.index, prefetch.written, _host_leaves(stack))
            for stack, prefetch in zip(self.groups, self.prefetched, strict=True)
        )
        return self.replace(groups=groups, prefetched=())

    def _with_host_groups(self, groups: tuple[int, ...], every: bool) -> Cache:
        """This cache with the K/V of ``groups`` moved to host memory and recorded as offloaded.
        A group without K/V (a linear-attention state) is left out under ``every`` (``offload="all"``),
        else an error."""
        kv_free = [g for g in groups if not any(jax.tree.leaves(_host_leaves(self.groups[g])))]
        if kv_free and not every:
            names = sorted({self.layer_types[g] for g in kv_free})
            raise ValueError(f"offload names {names} layers, which hold no K/V to offload (a state stays on device)")
        groups = tuple(g for g in groups if g not in kv_free)
        placed = tuple(_in_host_memory(g) if i in groups else g for i, g in enumerate(self.groups))
        return self.replace(groups=placed, offloaded=groups)

    def with_page_copies(self, copies: dict) -> Cache:
        """Pages copied in every paged group before a step writes: ``copies`` ``[K, 2]`` (source,
        destination) per pool name (``PagedStorage``; the engine's forks)."""
        for stack in self.groups:
            require(stack, PagedStorage, _PAGED_FIX)
        return self.replace(groups=tuple(stack.with_page_copies(copies) for stack in self.groups))

    def with_group(self, group: int, stack: CacheLayer) -> Cache:
        """This cache with group ``group`` replaced by ``stack`` (constrained to the layout)."""
        if self.layout is not None:
            stack = constrain(stack, self.group_shardings(stack))
        return self.replace(groups=_replaced(self.groups, group, stack))

    # --- per-layer views ----------------------------------------------------------
    def layer(self, layer_idx: int) -> CacheLayer:
        """Layer ``layer_idx`` as a single (unstacked) layer, for inspection."""
        group, index = self.locate(layer_idx)
        return self.groups[group].unstacked(index)

    @property
    def layers(self) -> tuple[CacheLayer, ...]:
        """Every layer in model order, unstacked (a copy: for inspection, not hot loops)."""
        return tuple(self.layer(i) for i in range(len(self.layer_types)))

    def _map_layers(self, fn) -> Cache:
        """Apply a per-layer pure function to every layer of every group."""
        return self.replace(groups=tuple(self._each_layer(g, fn) for g in range(self.period))).constrained()

    def _each_layer(self, group: int, fn) -> CacheLayer:
        """``fn`` (single layer -> single layer) on every layer of group ``group``: vmapped, or for
        an offloaded group one layer on the device at a time."""
        stack = self.groups[group]
        if group in self.offloaded:
            return map_entries(fn, stack, _host_leaves(stack))
        return jax.vmap(fn)(stack)

    # --- sharding -------------------------------------------------------------------
    def logical_axes(self) -> Cache:
        """This cache with every array leaf replaced by the ``Axes`` naming its dimensions
        (``layers`` first, then the layer's own; see ``CacheLayer.logical_axes``)."""
        return self.replace(groups=tuple(with_layers(first_entry_shapes(g).logical_axes()) for g in self.groups))

    def group_shardings(self, stack: CacheLayer):
        """``NamedSharding`` per leaf of a group ``stack`` under this cache's layout."""
        return self.layout.shardings(with_layers(first_entry_shapes(stack).logical_axes()), stack)

    def shardings(self) -> Cache:
        """``NamedSharding`` per leaf under the layout (requires one: see ``from_layer_types``'s ``mesh``)."""
        if self.layout is None:
            raise ValueError("this cache has no mesh: build it with Cache.from_config(..., mesh=...)")
        return self.layout.shardings(self.logical_axes(), self)

    def constrained(self) -> Cache:
        """Every leaf constrained to the layout's sharding (unchanged without a layout)."""
        return self if self.layout is None else constrain(self, self.shardings())

    def device_bytes(self) -> dict:
        """Bytes each addressable device holds of this cache in its own memory (read from
        ``addressable_shards``); offloaded K/V is counted by ``host_bytes``."""
        return device_bytes([leaf for leaf in jax.tree.leaves(self) if not on_host(leaf)])

    def host_bytes(self) -> dict:
        """Bytes of this cache in host memory, per device it is attached to (offloaded K/V)."""
        return device_bytes([leaf for leaf in jax.tree.leaves(self) if on_host(leaf)])

    # --- lengths, capacity, footprint --------------------------------------------
    @property
    def lengths(self) -> jax.Array:
        """``[B]`` int32: tokens each row has seen (absolute count, not stored slots)."""
        return self.groups[0].lengths[0]

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
        bounds = [first_entry_shapes(g).max_length for g in self.groups]
        bounds = [b for b in bounds if b is not None]
        return min(bounds) if bounds else None

    @property
    def max_rollback(self) -> int | None:
        """Most tokens ``rollback`` may undo in every layer (None: unbounded; 0 with a layer
        without ``Rollback``)."""
        budgets = [first_entry_shapes(g).max_rollback if has(g, Rollback) else 0 for g in self.groups]
        budgets = [b for b in budgets if b is not None]
        return min(budgets) if budgets else None

    def exact_chunk_lengths(self) -> jax.Array | None:
        """``[B]`` int32: the most tokens the next update of each row may bring so that every
        query sees the cache exactly as it would decoding token by token; None when any
        number may (layers with ``ChunkLimit``: quantized layers with a residual limit it; see
        ``QuantizedLayer.exact_chunk_lengths``). Speculative verification stays within it."""
        limits = [g.exact_chunk_lengths() for g in self.groups if has(g, ChunkLimit)]
        limits = [limit for limit in limits if limit is not None]
        return jnp.min(jnp.stack([jnp.min(limit, axis=0) for limit in limits]), axis=0) if limits else None

    @property
    def overflowed(self) -> jax.Array:
        """``[B]`` bool: rows some layer could not store (only possible under jit, in a layer with ``Overflow``)."""
        flags = [jnp.any(jax.vmap(lambda layer: layer.overflowed)(g), axis=0) for g in self.groups if has(g, Overflow)]
        return jnp.any(jnp.stack(flags), axis=0) if flags else jnp.zeros(self.lengths.shape, bool)

    @property
    def nbytes(self) -> int:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self))

    def reserve(self, num_new_tokens: int) -> Cache:
        """Grow growing layers (outside jit) so each row can take ``num_new_tokens`` more."""
        if is_traced(self.lengths):
            raise RuntimeError("Cache.reserve reads the row lengths and must run outside jit")
        needed = int(np.max(to_host(self.lengths), initial=0)) + int(num_new_tokens)
        return self.grow(bucket(needed))

    def grow(self, capacity: int) -> Cache:
        """Layers with ``Growth`` with room for ``capacity`` tokens (never shrinks); the others keep
        the capacity they were built with."""

        def grown(group: int) -> CacheLayer:
            stack = self.groups[group]
            if not has(stack, Growth):
                return stack
            if group not in self.offloaded:
                return stack.grow(capacity)
            if _shapes(jax.eval_shape(lambda s: s.grow(capacity), stack)) == _shapes(stack):
                return stack  # room already: no layer makes the round trip
            return self._each_layer(group, lambda layer: layer.grow(capacity))

        return self.replace(groups=tuple(grown(g) for g in range(self.period))).constrained()

    # --- batch and time edits -----------------------------------------------------
    def reorder(self, beam_indices) -> Cache:
        """Row i of the result is row ``beam_indices[i]`` of this cache, in every leaf."""
        indices = jnp.asarray(beam_indices, jnp.int32)
        if indices.ndim != 1:
            raise ValueError(f"reorder/select take a [B'] index vector, got shape {indices.shape}")
        # Check the caller's value, not ``indices``: under jit even a constant becomes a tracer.
        if not is_traced(beam_indices):
            given = np.asarray(beam_indices)
            if given.size and (given.min() < 0 or given.max() >= self.batch_size):
                raise IndexError(f"row indices {given.tolist()} out of range for batch {self.batch_size}")
        self._require(RowSelection)
        return self._map_layers(lambda layer: layer.gather_rows(indices))

    select = reorder

    def reorder_in_groups(self, indices) -> Cache:
        """Beams reordered within their prompt: rows come in groups of ``K`` (``indices`` ``[G, K]``),
        and row ``g * K + k`` of the result is row ``g * K + indices[g, k]``. The same as ``reorder``
        of the flattened row numbers, but no row leaves its group, so a batch sharded over ``data``
        by whole groups reorders on each device without moving K/V between them."""
        indices = jnp.asarray(indices, jnp.int32)
        if indices.ndim != 2 or indices.shape[0] * indices.shape[1] != self.batch_size:
            raise ValueError(
                f"reorder_in_groups takes [G, K] indices with G * K = {self.batch_size} rows, got {indices.shape}"
            )
        self._require(RowSelection)
        return self._map_layers(lambda layer: layer.gather_rows_in_groups(indices))

    def repeat(self, num_repeats: int) -> Cache:
        """Each row ``num_repeats`` times in a row (one prefilled prompt -> N beams/samples)."""
        if num_repeats <= 0:
            raise ValueError(f"num_repeats must be positive, got {num_repeats}")
        self._require(RowSelection)
        return self._map_layers(lambda layer: layer.repeat_rows(num_repeats))

    def rollback(self, num_tokens) -> Cache:
        """Forget the last ``num_tokens`` (int or ``[B]``) of each row in every layer.

        Eagerly, more than ``max_rollback``, or more than a row's ``rollback_budget`` in some
        layer (rollbacks without a feed in between share a ring's or a linear state's budget),
        is an error naming the fix, and so is any count where a layer has no ``Rollback``. Under
        jit the count is clamped to the smallest budget of every layer (0 for a layer without
        ``Rollback``) and to each row's length, so all layers undo the same count and stay in
        step; feed the tokens again at the positions ``next_positions`` gives.
        """
        n = functools.reduce(jnp.minimum, [limit_rollback(group, num_tokens, self.lengths) for group in self.groups])
        return self._map_layers(lambda layer: layer.rollback(n) if has(layer, Rollback) else layer)

    def evict(self, spec: EvictionSpec) -> Cache:
        """Every layer with ``Eviction`` cut to ``spec``'s budget by the scores it stored
        (``EvictingLayer.evict_to``); the other layers (Gemma 3's sliding rings) unchanged. One
        prefill into an ``EvictionSpec.observer`` cache then serves every budget of a sweep."""
        if not any(has(group, Eviction) for group in self.groups):
            lacking = "; ".join(dict.fromkeys(missing(group, Eviction) for group in self.groups))
            raise ValueError(
                f"Cache.evict: this cache has no evicting layers ({lacking}); build it with eviction=EvictionSpec(...)"
            )
        num_layers = len(self.layer_types)
        groups = tuple(
            group.evict_to(spec, self.group_layers(g), num_layers) if has(group, Eviction) else group
            for g, group in enumerate(self.groups)
        )
        return self.replace(groups=groups).constrained()

    def _require(self, capability: type) -> None:
        """A ``TypeError`` naming the first layer without ``capability`` (a check of the classes)."""
        for group in self.groups:
            require(group, capability)

    def group_layers(self, group: int) -> list[int]:
        """The model layers group ``group`` stores, its entries in order."""
        return list(self.stored_layers[group :: self.period])

    def reset(self) -> Cache:
        """Empty every layer, keeping shapes (and so the compiled steps)."""
        return self._map_layers(lambda layer: layer.reset())

    # --- display ------------------------------------------------------------------
    def __repr__(self) -> str:
        if has(self.groups[0], PagedStorage):  # rows and lengths are the engine's, on the host
            rows = [f"Cache(paged, layers={len(self.layer_types)}, {human_bytes(self.nbytes)})"]
        else:
            lengths = "traced" if is_traced(self.lengths) else to_host(self.lengths).tolist()
            rows = [
                f"Cache(batch={self.batch_size}, layers={len(self.layer_types)}, lengths={lengths}, "
                f"{human_bytes(self.nbytes)})"
            ]
        for i, kind in enumerate(self.layer_types):
            if self.kv_source(i) != i:
                rows.append(f"  {i:>3} {kind:<18} reuses layer {self.kv_source(i)}'s K/V")
                continue
            layer = first_entry_shapes(self.groups[self.locate(i)[0]])
            leaf = jax.tree.leaves(layer)[0]
            per_layer = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layer))
            rows.append(
                f"  {i:>3} {kind:<18} {type(layer).__name__:<19} {layer.describe():<14} "
                f"{str(list(leaf.shape)):<18} {str(leaf.dtype):<9} {human_bytes(per_layer):>10}"
            )
        return "\n".join(rows)
