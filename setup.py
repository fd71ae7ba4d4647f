"""The native CPU kernels (``jaxkv/kernels/cpu/*.cc``, XLA FFI handlers) as one shared library,
``jaxkv.kernels._cpu``, loaded with ctypes by ``jaxkv.kernels.native`` (it is not a Python module).

Built for the machine that builds it (``-march=native``: the setup command runs on the machine
that uses it). Optional: where there is no compiler, or the build fails, the install goes on
without it and jaxkv runs its pure-JAX paths (``jaxkv.kernels.native`` says so in one log line).
Everything else about the package is in pyproject.toml."""

import os
from glob import glob

from setuptools import Extension, setup


def _ffi_include_dir() -> str:
    """jaxlib's headers of XLA's FFI (what ``jax.ffi.include_dir()`` returns), without importing jax."""
    import jaxlib

    return os.path.join(os.path.dirname(jaxlib.__file__), "include")


CPU_KERNELS = Extension(
    "jaxkv.kernels._cpu",
    sources=sorted(glob("jaxkv/kernels/cpu/*.cc")),
    depends=sorted(glob("jaxkv/kernels/cpu/*.h")),
    include_dirs=[_ffi_include_dir(), "jaxkv/kernels/cpu"],
    language="c++",
    # -ffp-contract=off: no fused multiply-add unless a kernel writes one (the block dequantization
    # is bit-exact against gguf's, which rounds the product and the sum apart).
    extra_compile_args=["-std=c++17", "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno"],
    optional=True,
)

setup(ext_modules=[CPU_KERNELS])
