"""jaxkv: functional KV caches for JAX."""

from jaxkv.attention import attention, attention_mask
from jaxkv.cache import LAYER_TYPES, Cache, LayerSpec, layer_types_of
from jaxkv.dynamic import DynamicLayer
from jaxkv.memory import cache_bytes, layer_bytes
from jaxkv.protocol import CacheLayer, KVView, MaskInfo
from jaxkv.static import StaticLayer
from jaxkv.windowed import ChunkedLayer, SlidingWindowLayer

__all__ = [
    "LAYER_TYPES",
    "Cache",
    "CacheLayer",
    "ChunkedLayer",
    "DynamicLayer",
    "KVView",
    "LayerSpec",
    "MaskInfo",
    "SlidingWindowLayer",
    "StaticLayer",
    "attention",
    "attention_mask",
    "cache_bytes",
    "layer_bytes",
    "layer_types_of",
]
