"""K/V memory per layer type: closed-form formulas, and exact totals for a model config."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.cache import Cache, layer_types_of
from jaxkv.layers.dynamic import DynamicLayer
from jaxkv.encoder_decoder import EncoderDecoderCache
from jaxkv.layers.linear import LinearAttentionLayer
from jaxkv.layers.quantized import QuantizedLayer, QuantSpec
from jaxkv.layers.static import StaticLayer
from jaxkv.layers.windowed import ChunkedLayer, SlidingWindowLayer
from jaxkv.sizing import bucket

# (layer type, full-attention kind) -> the class that stores it, for formulas and tables.
LAYER_CLASSES = {
    ("full_attention", "static"): StaticLayer,
    ("full_attention", "dynamic"): DynamicLayer,
    ("sliding_attention", None): SlidingWindowLayer,
    ("chunked_attention", None): ChunkedLayer,
    ("cross_attention", None): EncoderDecoderCache,
    ("linear_attention", None): LinearAttentionLayer,
    ("conv", None): LinearAttentionLayer,
    ("full_attention", "quantized"): QuantizedLayer,
}


def layer_class(layer_type: str, full_attention: str = "static"):
    key = (layer_type, full_attention if layer_type == "full_attention" else None)
    if key not in LAYER_CLASSES:
        raise ValueError(f"no memory formula for layer type {layer_type!r}; known: {sorted({k[0] for k in LAYER_CLASSES})}")
    return LAYER_CLASSES[key]


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
    if quantization is not None:  # full or sliding attention stored quantized
        if layer_type not in ("full_attention", "sliding_attention"):
            raise ValueError(f"quantization covers full_attention and sliding_attention layers, not {layer_type!r}")
        linear_state["quantization"] = quantization
    elif full_attention == "quantized":
        raise ValueError("full_attention='quantized' needs quantization=QuantSpec(...) to size its codes and scales")
    cls = QuantizedLayer if quantization is not None else layer_class(layer_type, full_attention)
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
    for (layer_type, kind), cls in LAYER_CLASSES.items():
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
        sizes = [cache_bytes(config, batch_size, n, dtype) / 2**20 for n in seq_lens]
        rows.append(f"| {name} | {mix} | " + " | ".join(f"{s:,.1f} MiB" for s in sizes) + " |")
    return "\n".join(rows)
