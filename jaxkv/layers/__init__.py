"""Storage strategies: one module per family of cache layer, each keeping ``jaxkv.protocol``."""

from jaxkv.layers.dynamic import DynamicLayer
from jaxkv.layers.linear import HybridLayer, LinearAttentionLayer
from jaxkv.layers.quantized import QuantizedLayer
from jaxkv.quantization import QuantSpec
from jaxkv.layers.static import StaticLayer
from jaxkv.layers.windowed import ChunkedLayer, SlidingWindowLayer

__all__ = [
    "ChunkedLayer",
    "DynamicLayer",
    "HybridLayer",
    "LinearAttentionLayer",
    "QuantSpec",
    "QuantizedLayer",
    "SlidingWindowLayer",
    "StaticLayer",
]
