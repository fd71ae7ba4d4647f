"""Serving: continuous batching over paged K/V with chunked prefill and prefix caching."""

from jaxkv.serving.engine import Engine, EngineConfig
from jaxkv.serving.requests import Completion, RequestOutput

__all__ = ["Completion", "Engine", "EngineConfig", "RequestOutput"]
