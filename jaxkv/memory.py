"""K/V memory per layer type: closed-form formulas, and exact totals for a model config."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.cache import LAYER_TYPES, Cache, kv_sources_of, layer_types_of
from jaxkv.encoder_decoder import EncoderDecoderCache
from jaxkv.layers.linear import LinearAttentionLayer
from jaxkv.quantization import QuantSpec
from jaxkv.sizing import bucket

# (layer type, kind, class): the class that stores a layer type, of that full-attention kind
# ('static', 'dynamic', 'quantized'; None for a type with one storage).
StorageRow = tuple[str, str | None, type]

# Cross-attention K/V live in an EncoderDecoderCache next to a Cache: no Cache layer type.
CROSS_ATTENTION: StorageRow = ("cross_attention", None, EncoderDecoderCache)
# A layer that reuses an earlier layer's K/V (``Cache.kv_sources``) stores nothing: the table's row.
SHARED_KV_ROW = (
    "| any type, reusing K/V (`kv_sources`) | - | nothing: attends over the K/V of the earlier layer of its type that "
    "stores them (Gemma 4's last `num_kv_shared_layers`) | `0` (the storing layer's bytes, counted once) |"
)


def storage_rows() -> list[StorageRow]:
    """Every storage with a byte formula: ``cache.LAYER_TYPES``' classes, their quantized and
    paged classes (each once, under the first type that has it) and cross-attention's. In the
    table's order: K/V at the cache dtype (self-, then cross-attention), fixed-size states,
    quantized K/V, evicted K/V, retrieved K/V, paged K/V."""
    rows = [(name, kind, cls) for name, layer_type in LAYER_TYPES.items() for kind, cls in layer_type.storage.items()]
    for kind, storage_of in (
        ("quantized", lambda t: t.quantized),
        ("evicted", lambda t: t.evicted),
        ("retrieved", lambda t: t.retrieved),
        ("paged", lambda t: t.paged),
    ):
        first_with = {}
        for name, layer_type in LAYER_TYPES.items():
            first_with.setdefault(storage_of(layer_type), name)
        rows += [(name, kind, cls) for cls, name in first_with.items() if cls is not None]
    rows.append(CROSS_ATTENTION)
    return sorted(rows, key=_table_section)


def _table_section(row: StorageRow) -> int:
    _, kind, cls = row
    sections = {"quantized": 2, "evicted": 3, "retrieved": 4, "paged": 5}
    return sections.get(kind, 1 if issubclass(cls, LinearAttentionLayer) else 0)


def layer_class(layer_type: str, full_attention: str = "static") -> type:
    """The class storing ``layer_type``; ``full_attention`` picks among a type's kinds."""
    kinds = {kind: cls for name, kind, cls in storage_rows() if name == layer_type}
    cls = kinds.get(full_attention, kinds.get(None))  # a type with one storage keeps it for every kind
    if cls is None:
        known = sorted({name for name, _, _ in storage_rows()})
        raise ValueError(f"no memory formula for layer type {layer_type!r}; known: {known}")
    return cls


def quantized_class(layer_type: str, full_attention: str, quantization: QuantSpec | None) -> type | None:
    """The class storing ``layer_type`` under ``quantization`` (None without one)."""
    if quantization is None:
        if full_attention == "quantized":
            raise ValueError(
                "full_attention='quantized' needs quantization=QuantSpec(...) to size its codes and scales"
            )
        return None
    cls = LAYER_TYPES[layer_type].quantized if layer_type in LAYER_TYPES else None
    if cls is None:
        quantizable = " and ".join(name for name, t in LAYER_TYPES.items() if t.quantized is not None)
        raise ValueError(f"quantization covers {quantizable} layers, not {layer_type!r}")
    return cls


def layer_bytes(
    layer_type: str,
    *,
    batch_size: int,
    seq_len: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
    window: int | None = None,
    chunk: int | None = None,
    rollback_slots: int = 0,
    full_attention: str = "static",
    quantization: QuantSpec | None = None,
    **linear_state,
) -> int:
    """Bytes one layer of ``layer_type`` holds for ``batch_size`` rows of ``seq_len`` tokens
    (a static layer sized exactly ``seq_len``). Equals the allocated layer's ``nbytes``.
    ``linear_state``: ``conv_width``, ``conv_channels``, ``state_shapes`` of a
    linear-attention or conv layer (its bytes do not depend on ``seq_len``). ``quantization``:
    a ``QuantSpec`` for full or sliding attention stored quantized."""
    cls = quantized_class(layer_type, full_attention, quantization)
    if cls is None:
        cls = layer_class(layer_type, full_attention)
    else:
        linear_state["quantization"] = quantization
    return cls.kv_bytes(
        batch_size, seq_len, num_kv_heads, head_dim, dtype,
        span=window if layer_type == "sliding_attention" else chunk, rollback_slots=rollback_slots, **linear_state,
    )  # fmt: skip


def cache_bytes(config, batch_size: int, seq_len: int, dtype=jnp.bfloat16, **cache_kwargs) -> int:
    """Exact bytes of ``Cache.from_config`` holding ``seq_len`` tokens (growing layers
    reserved in buckets), without allocating it."""
    shapes = jax.eval_shape(
        lambda: Cache.from_config(config, batch_size, max_length=seq_len, dtype=dtype, **cache_kwargs).grow(
            bucket(seq_len)
        )
    )
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes))


def formula_table() -> str:
    """Markdown: each layer type, its class and its memory formula."""
    rows = ["| layer type | class | stores | bytes per layer |", "|---|---|---|---|"]
    for layer_type, kind, cls in storage_rows():
        name = layer_type + (f" ({kind})" if kind else "")
        stores = (cls.__doc__ or "").strip().splitlines()[0].rstrip(".")
        rows.append(f"| `{name}` | `{cls.__name__}` | {stores} | `{cls.MEMORY_FORMULA}` |")
    return "\n".join(rows)


def model_table(configs: dict, seq_lens=(4096, 32768), batch_size: int = 1, dtype=jnp.bfloat16) -> str:
    """Markdown: total K/V bytes per model config at each length, static full attention."""
    head = "| model | layers | " + " | ".join(f"{n // 1024}k tokens" for n in seq_lens) + " |"
    rows = [head, "|---|---|" + "---|" * len(seq_lens)]
    for name, config in configs.items():
        types = layer_types_of(config)
        mix = ", ".join(f"{types.count(t)} {t}" for t in dict.fromkeys(types))
        reusing = sum(source != i for i, source in enumerate(kv_sources_of(config, types)))
        mix += f" ({reusing} reusing K/V)" if reusing else ""
        sizes = [cache_bytes(config, batch_size, n, dtype) / 2**20 for n in seq_lens]
        rows.append(f"| {name} | {mix} | " + " | ".join(f"{s:,.1f} MiB" for s in sizes) + " |")
    return "\n".join(rows)
