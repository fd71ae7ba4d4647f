"""jaxkv's native CPU kernels: the shared library ``jaxkv.kernels._cpu`` (``jaxkv/kernels/cpu/*.cc``,
built by ``setup.py`` with the package) and its XLA FFI targets.

``target(symbol)`` registers one handler of the library (``jax.ffi.register_ffi_target``, platform
``cpu``, once) and returns its target name for ``jax.ffi.ffi_call``; None when the kernels are off:
no library (installed without a compiler, or its build failed) or ``JAXKV_CPU_KERNELS=0``
(``JAXKV_CPU_LIBRARY=path`` loads another build of it). Then
callers take their pure-JAX path, and the first asker logs one line saying why (logger
``jaxkv.kernels.native``, level WARNING for a missing library, INFO for the variable).

The kernels run on XLA's intra-op thread pool (the FFI's thread-pool context: as many threads as
XLA's CPU client has, the process's CPU affinity), compiled for the building machine (``-march=native``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

LIBRARY = "jaxkv.kernels._cpu"
SWITCH = "JAXKV_CPU_KERNELS"  # "0": the kernels are off (the pure-JAX paths run)
OVERRIDE = "JAXKV_CPU_LIBRARY"  # a path: load that build of the library instead (a kernel developer's own)
_PREFIX = "jaxkv_"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (said once in a log line)."""
    if os.environ.get(SWITCH, "1") == "0":
        logger.info("jaxkv CPU kernels off (%s=0): pure-JAX paths", SWITCH)
        return None
    if os.environ.get(OVERRIDE):
        return ctypes.CDLL(os.environ[OVERRIDE])
    spec = importlib.util.find_spec(LIBRARY)
    if spec is None or spec.origin is None:
        logger.warning(
            "jaxkv CPU kernels off: %s was not built (no C++ compiler at install?); pure-JAX paths. "
            "Reinstall with g++ present (bash scripts/setup.sh) to build them.", LIBRARY,
        )  # fmt: skip
        return None
    return ctypes.CDLL(spec.origin)


def available() -> bool:
    """Whether the native kernels are there (and not switched off)."""
    return library() is not None


@functools.cache
def target(symbol: str) -> str | None:
    """The FFI target name of the library's handler ``symbol`` (registered for CPU on first use),
    or None when the kernels are off."""
    lib = library()
    if lib is None:
        return None
    name = _PREFIX + symbol
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return name


def pool_threads() -> int | None:
    """How many threads XLA's intra-op pool gives the kernels here; None when they are off."""
    name = target("JaxkvCpuThreads")
    if name is None:
        return None
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((), jnp.int32))
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return int(jax.jit(call)())
