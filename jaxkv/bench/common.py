"""What the benchmarks share: the test model, a model and its sizes in either framework, a worker's
fresh process (its spec in and its result out through JSON files), the median of repeated runs,
the machine's description, and the report's cells and targets."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

DEVICES = ("cpu", "gpu")  # --device: where the systems run

# A random Llama small enough for tests (no download, no tokenizer): --model tiny-random.
TINY = "tiny-random"
TINY_CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
)  # fmt: skip  head_dim 64: the quantized formats' groups of 64 channels fit

LOG_TAIL = 3000  # characters of a failed worker's output in the parent's message
# The vector instruction sets a CPU kernel may pick (vLLM's CPU attention and GEMMs have AVX-512 and AMX paths).
VECTOR_ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
VERSIONS = ("jax", "jaxlib", "flax", "torch", "transformers", "numpy")  # the environment's packages


# ----------------------------------------------------------------------------------------------
# the machine


def cpu_cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def peak_rss_mib() -> float:
    """This process's peak resident memory, MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def cpu_vector_isa() -> list[str]:
    """Which of ``VECTOR_ISA`` this CPU has (``/proc/cpuinfo``'s flags; empty where unreadable)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return []
    return [isa for isa in VECTOR_ISA if isa in flags]


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _versions() -> dict[str, str | None]:
    import importlib.metadata

    versions = {}
    for dist in VERSIONS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def environment(threads: int) -> dict:
    """The machine and the packages a report was measured with (``threads``: torch's)."""
    return dict(
        cpu=_cpu_name(), cpu_vector_isa=cpu_vector_isa(), cores=cpu_cores(), torch_threads=threads,
        platform=platform.platform(), python=platform.python_version(), versions=_versions(),
        load_average=os.getloadavg() if hasattr(os, "getloadavg") else None,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# models


def jaxkv_model(model: str, dtype: str, **options):
    """jaxkv's model ``model`` (a name, .gguf or checkpoint, or ``TINY``) in ``dtype``; ``options``
    for the model (``scan_layers``, ``weight_layout``)."""
    import jax.numpy as jnp

    if model == TINY:
        from jaxkv.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(**TINY_CONFIG), dtype=jnp.dtype(dtype), **options)
    from jaxkv.models.load import load_pretrained

    return load_pretrained(model, dtype=jnp.dtype(dtype), **options)[0]


def jaxkv_sizes(model, dtype: str) -> dict:
    """Parameter bytes and K/V bytes per cached token of jaxkv's ``model`` in ``dtype``."""
    import jax
    from flax import nnx

    config = model.config
    itemsize = jax.numpy.dtype(dtype).itemsize
    return dict(
        param_bytes=int(sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))),
        kv_bytes_per_token=2 * config.num_hidden_layers * config.kv_heads * config.dim_per_head * itemsize,
    )


def hf_model(model: str, dtype: str):
    """transformers' model ``model`` (``TINY``: seeded random weights) in ``dtype``, in eval mode."""
    import torch
    import transformers

    torch_dtype = getattr(torch, dtype)
    if model == TINY:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_CONFIG)).to(torch_dtype).eval()
    from jaxkv.models.defaults import resolve_model

    path = resolve_model(model)
    if path.suffix == ".gguf":
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                   dtype=torch_dtype)  # fmt: skip
    else:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    return loaded.eval()


def hf_sizes(model) -> dict:
    """Parameter bytes and K/V bytes per cached token of a transformers model."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return dict(
        param_bytes=int(sum(p.numel() * p.element_size() for p in model.parameters())),
        kv_bytes_per_token=2 * config.num_hidden_layers * kv_heads * head_dim * next(model.parameters()).element_size(),
    )


# ----------------------------------------------------------------------------------------------
# fresh worker processes


def worker_env(device: str = "cpu") -> dict:
    """A worker's environment: offline hub, quiet tokenizers and progress bars; JAX on the GPU
    only for ``--device gpu`` (else JAX's default)."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if device == "gpu":
        env["JAX_PLATFORMS"] = "cuda"
    return env


def run_worker(command: list[str], spec: dict, *, label: str, device: str, timeout: float | None,
               verbose: bool) -> dict:  # fmt: skip
    """``spec`` run by a fresh process, so its memory, compile caches and thread pools are its own:
    the spec goes to a temporary JSON file (with the ``result_path`` the worker writes to), and
    ``command`` runs with that file as its last argument under ``worker_env(device)``. Its result
    with its wall seconds (``worker_wall_s``), or ``{"error": ...}``; ``verbose`` shows its output."""
    print(f"[bench] {label} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxkv-bench-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec | {"result_path": str(result_path)}))
        output = None if verbose else subprocess.PIPE
        try:
            proc = subprocess.run([*command, str(spec_path)], check=False, env=worker_env(device), stdout=output,
                                  stderr=output, text=True, timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            print(f"[bench] {label}: timed out after {timeout} s", file=sys.stderr)
            return {"error": f"timed out after {timeout} s"}
        if proc.returncode != 0 or not result_path.is_file():
            return _failed(label, proc)
        result = json.loads(result_path.read_text())
    wall = time.perf_counter() - start
    print(f"[bench] {label}: done in {wall:.1f} s", file=sys.stderr, flush=True)
    return result | {"worker_wall_s": wall}


def run_install_step(command: list[str], what: str, error: type[Exception], env: dict | None = None) -> None:
    """One step of making a peer's venv (``vllm_env``, ``llama_cpp_env``): ``command`` run to its
    end; ``error`` naming ``what`` with the output's last ``LOG_TAIL`` characters if it fails."""
    proc = subprocess.run(command, check=False, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-LOG_TAIL:].strip()
        raise error(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _failed(label: str, proc: subprocess.CompletedProcess) -> dict:
    """A failed worker's error: its exit status and the last line of its output (all of it on stderr)."""
    tail = ((proc.stderr or "") + (proc.stdout or ""))[-LOG_TAIL:].strip()
    print(f"[bench] {label}: worker failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
    return {"error": f"exit {proc.returncode}: {tail.splitlines()[-1] if tail else 'see --verbose'}"}


def run_as_worker(spec_path: Path, run: Callable[[dict], dict]) -> int:
    """A worker's side of ``run_worker``: ``run`` on the spec it wrote, the result with the worker's
    seconds and peak RSS written where the spec says."""
    spec = json.loads(spec_path.read_text())
    result_path = Path(spec.pop("result_path"))
    start = time.perf_counter()
    result = run(spec)
    result.update(worker_s=time.perf_counter() - start, peak_rss_mib=peak_rss_mib())
    result_path.write_text(json.dumps(result))
    return 0


def median_run(runs: list[dict], key: str) -> dict | None:
    """The successful run (no ``error``) of median ``key`` among ``runs`` of one configuration (the
    lower of the two middle ones of an even count); None when every run failed."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r[key])
    return ok[(len(ok) - 1) // 2] if ok else None


# ----------------------------------------------------------------------------------------------
# reports


def fmt(value: float | None, spec: str = ".1f", scale: float = 1.0) -> str:
    """A table cell: ``value * scale`` in ``spec``, or '-' when there is none."""
    return "-" if value is None else format(value * scale, spec)


def print_targets(targets: list[dict]) -> None:
    """The targets section: ``[PASS]``, ``[FAIL]`` or ``[n/a]`` (not measured), its name and value."""
    print("\n### Targets\n")
    for t in targets:
        mark = {True: "PASS", False: "FAIL", None: "n/a"}[t["passed"]]
        print(f"- [{mark}] {t['target']}: {t['display']}")
