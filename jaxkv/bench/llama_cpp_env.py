"""llama.cpp beside jaxkv: llama-cpp-python built from source for this CPU, in its own venv.

    python -m jaxkv.bench.llama_cpp_env        # make it ahead of time (several minutes on 2 cores, once)

``jaxkv bench decode --systems ... llama.cpp`` makes it on first use. The step is idempotent: a
marker file is written once the venv imports ``llama_cpp``; a venv without it is made again (pip
then keeps what it already installed).

* the venv: ``~/.cache/jaxkv/llama-cpp-python-<version>``, ``pip install --no-binary
  llama-cpp-python --no-cache-dir llama-cpp-python==<version>``: llama.cpp compiled here by
  g++/CMake with ``CMAKE_ARGS`` = ``BUILD_FLAGS`` (``GGML_NATIVE``: ``-march=native``, the
  machine's own vector instructions; no GPU backend, no BLAS: ggml's own CPU kernels, OpenMP
  threads), on x86 less AMX (``NO_AMX``, through ``CFLAGS``/``CXXFLAGS``: ggml's AMX matmul
  crashed with a segmentation fault on the first decode on a Xeon VM that reports AMX; its
  AVX-512/AVX2 kernels and weight repacking stay). ``--no-cache-dir``: pip's wheel cache is keyed
  by the source, not by the flags or the CPU, so a wheel built elsewhere is never taken for this
  machine's. When the registry cannot be
  reached or the build fails, ``LlamaCppUnavailable`` says so (the benchmark then reports the
  llama.cpp rows as not run, with the reason).
* the model: the GGUF file itself (``jaxkv.models.defaults.resolve_model``), the same file jaxkv
  loads; no conversion.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxkv.bench.common import cpu_cores, run_install_step
from jaxkv.bench.vllm_env import CACHE, MARKER, PIP_TIMEOUT_S

LLAMA_CPP_VERSION = "0.3.36"  # llama-cpp-python; it vendors its llama.cpp
VENV = CACHE / f"llama-cpp-python-{LLAMA_CPP_VERSION}"
BUILD_FLAGS = ("-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DGGML_BLAS=OFF",
               "-DLLAVA_BUILD=OFF")  # fmt: skip  LLAVA_BUILD: its multimodal library, which a text model needs not
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit -mno-* win over -march=native's, in any order


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp's venv could not be made (the registry unreachable, a failed build)."""


def _build_env() -> dict:
    """This environment with the build's flags: ``CMAKE_ARGS``, on x86 ``NO_AMX`` as the compilers'
    flags (CMake starts ``CMAKE_C_FLAGS``/``CMAKE_CXX_FLAGS`` from them), and the build's
    parallelism (the usable cores)."""
    env = dict(os.environ, CMAKE_ARGS=" ".join(BUILD_FLAGS), CMAKE_BUILD_PARALLEL_LEVEL=str(cpu_cores()))
    if platform.machine() in ("x86_64", "AMD64"):
        env |= {name: f"{env.get(name, '')} {NO_AMX}".strip() for name in ("CFLAGS", "CXXFLAGS")}
    return env


def ensure_venv(venv: Path = VENV) -> Path:
    """The python of ``venv`` with llama-cpp-python built and importable; made on the first call."""
    python = venv / "bin" / "python"
    if (venv / MARKER).is_file():
        return python
    package = f"llama-cpp-python=={LLAMA_CPP_VERSION}"
    print(f"[llama.cpp] making {venv}: pip install {package}, built from source for this CPU (several minutes, "
          "once) ...", file=sys.stderr, flush=True)  # fmt: skip
    run_install_step([sys.executable, "-m", "venv", str(venv)], f"python -m venv {venv}", LlamaCppUnavailable)
    install = [str(python), "-m", "pip", "install", "--timeout", str(PIP_TIMEOUT_S), "--retries", "1", "--no-cache-dir",
               "--no-binary", "llama-cpp-python", package]  # fmt: skip
    env = _build_env()
    run_install_step(install, f"pip install {package} (is the package registry reachable? g++ and cmake installed?)",
                     LlamaCppUnavailable, env)  # fmt: skip
    run_install_step([str(python), "-c", "import llama_cpp"], f"import llama_cpp in {venv}", LlamaCppUnavailable)
    (venv / MARKER).write_text(f"{package}\nCMAKE_ARGS={env['CMAKE_ARGS']}\nCFLAGS={env.get('CFLAGS', '')}\n")
    print(f"[llama.cpp] {venv} ready", file=sys.stderr, flush=True)
    return python


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=VENV, help="where to make it")
    args = parser.parse_args(argv)
    try:
        python = ensure_venv(args.venv)
    except LlamaCppUnavailable as error:
        print(f"llama.cpp unavailable: {error}", file=sys.stderr)
        return 1
    print(f"venv python: {python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
