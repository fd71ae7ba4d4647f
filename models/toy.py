"""A tiny decoder with random weights that exercises every attention layer type.

It is the smallest model that uses the cache the way a real one does: one line per
attention layer, ``cache, out = cached_attention(cache, i, q, k, v, positions)``. Called
without a cache it attends over its own input, which is the oracle for the cached path.
"""

from __future__ import annotations

from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from jaxkv.attention import attention, cached_attention
from jaxkv.cache import Cache
from jaxkv.models.common import apply_rope, inverse_frequencies
from jaxkv.protocol import KVView, MaskInfo


class ToyConfig(BaseModel):
    # Strict like the app's configs (scripts/demo.py reads it from YAML): typos and wrong types are errors.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    vocab_size: PositiveInt = 97
    hidden_size: PositiveInt = 32
    num_attention_heads: PositiveInt = 4
    num_key_value_heads: PositiveInt = 2
    layer_types: Annotated[tuple[str, ...], Field(strict=False)] = (  # YAML gives a list
        "full_attention", "sliding_attention", "chunked_attention", "full_attention",
    )  # fmt: skip
    sliding_window: PositiveInt = 4
    attention_chunk_size: PositiveInt = 8
    rope_theta: float = 10_000.0

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class Block(nnx.Module):
    def __init__(self, config: ToyConfig, layer_idx: int, rngs: nnx.Rngs):
        self.config, self.layer_idx = config, layer_idx
        dim, head_dim = config.hidden_size, config.head_dim
        self.attn_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.q_proj = nnx.Linear(dim, config.num_attention_heads * head_dim, use_bias=False, rngs=rngs)
        self.kv_proj = nnx.Linear(dim, 2 * config.num_key_value_heads * head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(config.num_attention_heads * head_dim, dim, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, positions, cache: Cache | None):
        config = self.config
        batch, length, _ = x.shape
        heads = lambda t, n: t.reshape(batch, length, n, config.head_dim).transpose(0, 2, 1, 3)  # noqa: E731
        inv_freq = inverse_frequencies(config.rope_theta, config.head_dim)
        h = self.attn_norm(x)
        q = apply_rope(heads(self.q_proj(h), config.num_attention_heads), positions, inv_freq)
        k, v = jnp.split(self.kv_proj(h), 2, axis=-1)
        k = apply_rope(heads(k, config.num_key_value_heads), positions, inv_freq)
        v = heads(v, config.num_key_value_heads)
        if cache is None:  # no cache: attend over this input only (the oracle path)
            out = attention(q, KVView.of(k, v, self.own_mask(positions)), positions)
        else:
            cache, out = cached_attention(cache, self.layer_idx, q, k, v, positions)
        x = x + self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))
        x = x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))
        return x, cache

    def own_mask(self, positions) -> MaskInfo:
        kind = self.config.layer_types[self.layer_idx]
        window = self.config.sliding_window if kind == "sliding_attention" else None
        chunk = self.config.attention_chunk_size if kind == "chunked_attention" else None
        return MaskInfo(positions, window=window, chunk=chunk)


class ToyDecoder(nnx.Module):
    """``logits, cache = model(tokens [B, T], positions [B, T], cache)``; padding positions are -1."""

    def __init__(self, config: ToyConfig, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        self.blocks = nnx.List([Block(config, i, rngs) for i in range(config.num_hidden_layers)])
        self.norm = nnx.RMSNorm(config.hidden_size, rngs=rngs)

    def __call__(self, tokens, positions, cache: Cache | None = None):
        x = self.embed(tokens)
        for block in self.blocks:
            x, cache = block(x, positions, cache)
        return self.embed.attend(self.norm(x)), cache
