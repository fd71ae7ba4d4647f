import copy
import functools
import os
from pathlib import Path

import jax
import pytest
from hypothesis import settings

# Eight host devices, as the sharding tests' meshes (1x8, 2x4, 4x2, 8x1) need; everything else runs
# on the first as before. Set before any test touches a backend.
jax.config.update("jax_num_cpu_devices", 8)

# CI replays the same examples every run; locally hypothesis explores.
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=12, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=12)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def parse_each_gguf_once() -> None:
    """transformers, the parity oracle, parses a GGUF's whole metadata (Gemma 3's 262k-token
    vocabulary included: 15-20 s here) for a model's config, again for its weights and again for
    its tokenizer's config. Each test process keeps one ``gguf.GGUFReader`` and one parsed
    metadata per file instead (both read-only), keyed by path, size and modification time so a
    rewritten file is read again."""
    try:
        import gguf
        import transformers.modeling_gguf_pytorch_utils as hf_gguf
    except ImportError:  # without the parity extra there is no oracle to speed up
        return

    def file_key(path) -> tuple:
        stat = Path(path).stat()
        return str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns

    uncached_reader, uncached_load = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    readers = functools.lru_cache(maxsize=8)(lambda key, mode: uncached_reader(key[0], mode))
    metadata = functools.lru_cache(maxsize=8)(lambda key: uncached_load(key[0], return_tensors=False))
    gguf.GGUFReader = lambda path, mode="r": readers(file_key(path), mode)

    def load_gguf_checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return uncached_load(path, return_tensors=return_tensors, **kwargs)
        return copy.deepcopy(metadata(file_key(path)))  # callers edit what they get

    hf_gguf.load_gguf_checkpoint = load_gguf_checkpoint


parse_each_gguf_once()


@pytest.fixture(autouse=True, scope="module")
def drop_compiled_executables():
    """After each test file, drop JAX's compiled executables: a worker process would
    otherwise keep those of every file it ran (GBs over the suite), and XLA's CPU compiler
    has aborted deep into such runs."""
    yield
    jax.clear_caches()


# Seconds each of the slowest test files took on this 2-core machine (one full run, 2026-12-03:
# 749 tests, 38 minutes). `--dist loadfile` hands whole files to the two workers in collection
# order, so running alphabetically left one worker alone with the last big files for minutes;
# longest first (the files not listed follow in their usual order) keeps both busy to the end.
FILE_SECONDS = {
    "test_engine.py": 320, "test_speculative.py": 264, "test_sharding.py": 241, "test_eviction.py": 227,
    "test_engine_models.py": 223, "test_quantized.py": 181, "test_gemma3.py": 180, "test_experiment.py": 165,
    "test_properties.py": 147, "test_models_toy.py": 135, "test_bench_serving.py": 132, "test_smollm2.py": 117,
    "test_engine_sharding.py": 111, "test_server.py": 111, "test_bench_smoke.py": 109, "test_qwen3_5_parity.py": 87,
    "test_beam.py": 78, "test_prefix_chat.py": 75, "test_mqar.py": 69, "test_sharding_table.py": 58,
}  # fmt: skip


def pytest_collection_modifyitems(items):
    """Longest-running files first (``FILE_SECONDS``); a file's own tests keep their order."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # a stable sort
