"""Attention backends: which implementation reads a paged view's decode tokens.

``xla``: jaxkv's own blocked reads (every view, every feature). ``pallas_gpu``: JAX's Pallas
GPU paged-attention kernel (Triton). ``pallas_tpu``: JAX's Pallas TPU paged-attention kernel
(Mosaic). ``auto``: the kernel of the platform JAX runs on, else ``xla`` (said in one log line).
A view routes to ``xla`` whatever the backend for the parts a kernel lacks
(``jaxkv.kernels.paged.kernel_route``).
"""

from __future__ import annotations

import logging

import jax

XLA, PALLAS_GPU, PALLAS_TPU, AUTO = "xla", "pallas_gpu", "pallas_tpu", "auto"
BACKENDS = (XLA, PALLAS_GPU, PALLAS_TPU, AUTO)
# The platform (``jax.default_backend()``) each kernel compiles for; elsewhere it runs interpreted.
KERNEL_PLATFORMS = {PALLAS_GPU: "gpu", PALLAS_TPU: "tpu"}

logger = logging.getLogger(__name__)


def check_backend(name: str, argument: str = "attention_backend") -> str:
    """``name`` if it is one of ``BACKENDS``, else a ValueError naming ``argument``."""
    if name not in BACKENDS:
        raise ValueError(f"{argument} must be one of {BACKENDS}, got {name!r}")
    return name


def resolve_backend(name: str, platform: str | None = None) -> str:
    """The concrete backend of ``name`` on ``platform`` (default: ``jax.default_backend()``):
    ``auto`` becomes the platform's kernel, or ``xla`` with one log line; the others are themselves
    (a kernel off its platform with one log line: it will run interpreted)."""
    platform = platform or jax.default_backend()
    if check_backend(name) != AUTO:
        if KERNEL_PLATFORMS.get(name, platform) != platform:
            logger.info(
                "attention_backend %s on platform %r: the kernel runs in Pallas interpret mode (slow)", name, platform
            )
        return name
    chosen = next((kernel for kernel, home in KERNEL_PLATFORMS.items() if home == platform), None)
    if chosen is None:
        logger.info("attention_backend auto: no Pallas paged-attention kernel for platform %r, using xla", platform)
        return XLA
    return chosen


def interpreted(backend: str) -> bool:
    """Whether ``backend``'s kernel runs in Pallas interpret mode here (JAX runs on another platform)."""
    return jax.default_backend() != KERNEL_PLATFORMS[backend]
