"""Attention backends: which implementation reads a paged view's decode tokens.

``xla``: jaxkv's own blocked reads (every view, every feature). ``pallas_gpu``: JAX's Pallas
GPU paged-attention kernel (Triton). ``pallas_tpu``: JAX's Pallas TPU paged-attention kernel
(Mosaic). ``cpu``: jaxkv's native CPU kernel (``jaxkv.kernels.cpu_paged``, XLA FFI), which reads
the pools in place. ``auto``: the kernel of the platform JAX runs on (on CPU the native kernel when
its library is there), else ``xla`` (said in one log line).
A view routes to ``xla`` whatever the backend for the parts a kernel lacks
(``jaxkv.kernels.paged.kernel_route``).
"""

from __future__ import annotations

import logging

import jax

from jaxkv.kernels import cpu_paged

XLA, PALLAS_GPU, PALLAS_TPU, CPU, AUTO = "xla", "pallas_gpu", "pallas_tpu", "cpu", "auto"
BACKENDS = (XLA, PALLAS_GPU, PALLAS_TPU, CPU, AUTO)
# The platform (``jax.default_backend()``) each Pallas kernel compiles for; elsewhere it runs interpreted.
KERNEL_PLATFORMS = {PALLAS_GPU: "gpu", PALLAS_TPU: "tpu"}

logger = logging.getLogger(__name__)


def check_backend(name: str, argument: str = "attention_backend") -> str:
    """``name`` if it is one of ``BACKENDS``, else a ValueError naming ``argument``."""
    if name not in BACKENDS:
        raise ValueError(f"{argument} must be one of {BACKENDS}, got {name!r}")
    return name


def resolve_backend(name: str, platform: str | None = None) -> str:
    """The concrete backend of ``name`` on ``platform`` (default: ``jax.default_backend()``):
    ``auto`` becomes the platform's kernel (on ``cpu`` the native kernel if its library is there), or
    ``xla`` with one log line; the others are themselves (a Pallas kernel off its platform with one
    log line: it will run interpreted). ``cpu`` off the CPU platform, or without the native library,
    is a ValueError: it has no interpreted mode."""
    platform = platform or jax.default_backend()
    if check_backend(name) == CPU:
        if platform != "cpu":
            raise ValueError(f"attention_backend cpu: the native kernel runs on the cpu platform, not {platform!r}")
        if not cpu_paged.available():
            raise ValueError("attention_backend cpu: the native CPU kernels are off (jaxkv.kernels.native's log line)")
        return name
    if name == AUTO and platform == "cpu":
        if cpu_paged.available():
            return CPU
        logger.info("attention_backend auto: the native CPU kernels are off, using xla")
        return XLA
    if name != AUTO:
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
