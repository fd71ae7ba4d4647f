"""jaxkv: functional KV caches for JAX."""

from jaxkv.attention import attention, attention_mask, cached_attention
from jaxkv.cache import LAYER_TYPES, Cache, LayerBuilder, LayerSpec, LayerType, layer_types_of
from jaxkv.encoder_decoder import EncoderDecoderCache
from jaxkv.eviction import EvictionSpec
from jaxkv.layers.dynamic import DynamicLayer
from jaxkv.layers.evicting import EvictingLayer
from jaxkv.layers.linear import HybridLayer, LinearAttentionLayer
from jaxkv.layers.quantized import QuantizedLayer
from jaxkv.quantization import QuantSpec
from jaxkv.layers.static import StaticLayer
from jaxkv.layers.windowed import ChunkedLayer, SlidingWindowLayer
from jaxkv.memory import cache_bytes, layer_bytes
from jaxkv.persist import load_cache, save_cache
from jaxkv.protocol import (
    BatchMajorLayer, CacheLayer, Capability, ChunkLimit, DepthBudgets, Eviction, Growth, HeldTokens, KVView,
    LinearState, MaskInfo, Overflow, Refill, Rollback, RowSelection,
)  # fmt: skip

__all__ = [
    "LAYER_TYPES",
    "BatchMajorLayer",
    "Cache",
    "CacheLayer",
    "Capability",
    "ChunkLimit",
    "ChunkedLayer",
    "DepthBudgets",
    "DynamicLayer",
    "EncoderDecoderCache",
    "EvictingLayer",
    "Eviction",
    "EvictionSpec",
    "Growth",
    "HeldTokens",
    "HybridLayer",
    "KVView",
    "LayerBuilder",
    "LayerSpec",
    "LayerType",
    "LinearAttentionLayer",
    "LinearState",
    "MaskInfo",
    "Overflow",
    "QuantSpec",
    "QuantizedLayer",
    "Refill",
    "Rollback",
    "RowSelection",
    "SlidingWindowLayer",
    "StaticLayer",
    "attention",
    "attention_mask",
    "cached_attention",
    "cache_bytes",
    "layer_bytes",
    "layer_types_of",
    "load_cache",
    "save_cache",
]
