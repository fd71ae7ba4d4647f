"""llama.cpp's worker in the decode benchmark, run by the python of llama.cpp's venv
(``jaxkv.bench.llama_cpp_env``): ``python llama_cpp_worker.py SPEC.json``.

Standard library only at import (that venv has no jaxkv; ``llama_cpp`` is imported by ``run``), so
the greedy loop and the spec's arithmetic are tested without llama.cpp. The result goes to
``spec['result_path']`` (JSON), as ``jaxkv.bench.common.run_worker`` reads it.

What it runs: llama.cpp's C API through llama-cpp-python's low-level bindings, the same path for
batch 1 and batch B (the high-level ``Llama`` class decodes one sequence): one context with B
sequences (``n_seq_max``), the prompt's ids for each sequence prefilled in one ``llama_decode``,
then ``new_tokens - 1`` decode steps of one token per sequence, each token chosen by llama.cpp's
greedy sampler (argmax in C). No stop token. A 2-token run first (its prefill gives the cold
TTFT; first-call allocations), the memory cleared, then the timed run, as transformers gets a
2-token warm-up in the decode benchmark.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

WARM_UP_TOKENS = 2
CONTEXT_ROUND = 256  # the context's cells per sequence, rounded up to this
MAX_UBATCH = 512  # llama.cpp's default physical batch: a longer prefill goes through in such pieces
KV_TYPE_BYTES = 2  # llama.cpp's default K/V cache type is f16
SHOWN_LOG_LEVELS = (3, 4)  # ggml_log_level WARN and ERROR reach stderr; not DEBUG, INFO nor their CONTinuations


class Decoder(Protocol):
    """llama.cpp's context as ``generate_rows`` drives it."""

    def decode(self, tokens: Sequence[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``(token id, position, sequence, wants logits)`` entries."""
        ...

    def greedy(self, index: int) -> int:
        """The greedy token of the logits of entry ``index`` of the last ``decode``."""
        ...


@dataclasses.dataclass(frozen=True)
class Rows:
    """``generate_rows``' result: ``tokens`` ``[batch][new_tokens]`` and ``time.perf_counter()``
    at its start, at the first token of every row (after the prefill) and at its end."""

    tokens: list[list[int]]
    start: float
    first_token: float
    end: float


def generate_rows(decoder: Decoder, prompt: Sequence[int], batch: int, new_tokens: int) -> Rows:
    """``batch`` sequences of ``prompt`` (ids), ``new_tokens`` greedy tokens each: the prefill of
    every sequence in one decode (logits at each sequence's last prompt token), then one decode a
    step of every sequence's last token."""
    length = len(prompt)
    start = time.perf_counter()
    decoder.decode([(token, position, row, position == length - 1) for row in range(batch)
                    for position, token in enumerate(prompt)])  # fmt: skip
    last = [decoder.greedy(row * length + length - 1) for row in range(batch)]
    first_token = time.perf_counter()
    tokens = [[token] for token in last]
    for step in range(1, new_tokens):
        decoder.decode([(last[row], length + step - 1, row, True) for row in range(batch)])
        last = [decoder.greedy(row) for row in range(batch)]
        for row, token in enumerate(last):
            tokens[row].append(token)
    return Rows(tokens, start, first_token, time.perf_counter())


def context_cells(batch: int, prompt_tokens: int, new_tokens: int) -> int:
    """The context's K/V cells: every sequence's prompt and new tokens, rounded up to ``CONTEXT_ROUND`` a sequence."""
    per_sequence = -(-(prompt_tokens + new_tokens) // CONTEXT_ROUND) * CONTEXT_ROUND
    return batch * per_sequence


class LlamaCppDecoder:
    """``Decoder`` over llama.cpp's C API (``llama_cpp``, llama-cpp-python's ctypes bindings): the
    model (mmapped, no GPU layers), one context of ``n_ctx`` cells for ``sequences`` sequences on
    ``threads`` threads (prefill and decode alike), a batch of up to ``n_batch`` entries, llama.cpp's
    greedy sampler."""

    def __init__(self, llama_cpp, path: str, *, n_ctx: int, n_batch: int, sequences: int, threads: int):
        self.lib = llama_cpp
        self.log = llama_cpp.llama_log_callback(_log)  # kept: llama.cpp calls it for the process's life
        llama_cpp.llama_log_set(self.log, None)
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, min(n_batch, MAX_UBATCH)
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} cells for {sequences} sequences")
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, sequences)
        self.sampler = llama_cpp.llama_sampler_init_greedy()

    def decode(self, tokens: Sequence[tuple[int, int, int, bool]]) -> None:
        batch = self.batch
        for i, (token, position, sequence, logits) in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, logits
            batch.seq_id[i][0] = sequence
        batch.n_tokens = len(tokens)
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for {len(tokens)} tokens")

    def greedy(self, index: int) -> int:
        return self.lib.llama_sampler_sample(self.sampler, self.ctx, index)

    def clear(self) -> None:
        """Forget every sequence's K/V (the warm-up's)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def metadata(self, key: str) -> str | None:
        """The GGUF's metadata value of ``key`` as text, or None."""
        buffer = ctypes.create_string_buffer(256)
        size = self.lib.llama_model_meta_val_str(self.model, key.encode(), buffer, len(buffer))
        return buffer.value.decode() if size >= 0 else None

    def sizes(self) -> dict:
        """The model's weight bytes (every tensor of the file) and the K/V bytes a cached token takes
        in llama.cpp's f16 cache: 2 (K and V) x layers x K/V heads x head size x 2 bytes."""
        lib, model = self.lib, self.model
        architecture = self.metadata("general.architecture")
        heads = lib.llama_model_n_head(model)
        head_size = int(self.metadata(f"{architecture}.attention.key_length") or lib.llama_model_n_embd(model) // heads)
        kv_heads = lib.llama_model_n_head_kv(model)
        return dict(
            param_bytes=int(lib.llama_model_size(model)),
            kv_bytes_per_token=2 * lib.llama_model_n_layer(model) * kv_heads * head_size * KV_TYPE_BYTES,
            architecture=architecture,
        )


def _log(level: int, text: bytes, user_data) -> None:
    if level in SHOWN_LOG_LEVELS:
        sys.stderr.write(text.decode(errors="replace"))


def run(spec: dict) -> dict:
    """Load, a ``WARM_UP_TOKENS`` run, then the timed run: the decode benchmark's row fields."""
    import llama_cpp

    prompt, batch, new = spec["prompt"], spec["batch"], spec["new_tokens"]
    n_ctx = context_cells(batch, len(prompt), new)
    start = time.perf_counter()
    decoder = LlamaCppDecoder(llama_cpp, spec["model_path"], n_ctx=n_ctx, n_batch=batch * len(prompt),
                              sequences=batch, threads=spec["threads"])  # fmt: skip
    load_seconds = time.perf_counter() - start
    cold = generate_rows(decoder, prompt, batch, min(WARM_UP_TOKENS, new))
    decoder.clear()
    rows = generate_rows(decoder, prompt, batch, new)
    sizes = decoder.sizes()
    return dict(
        prefill_s=rows.first_token - rows.start, decode_s=rows.end - rows.first_token, compile_s=0.0,
        ttft_s=cold.first_token - cold.start, cache_bytes=n_ctx * sizes["kv_bytes_per_token"], **sizes,
        load_s=load_seconds, tokens_head=rows.tokens[0][:16],
        rows_identical=all(tokens == rows.tokens[0] for tokens in rows.tokens),
        threads=spec["threads"], n_ctx=n_ctx, kv_type="f16", llama_cpp_python=llama_cpp.__version__,
        system_info=llama_cpp.llama_print_system_info().decode(),
    )  # fmt: skip


def main(argv: Sequence[str]) -> int:
    """``python llama_cpp_worker.py SPEC.json``: the result goes to ``spec['result_path']``."""
    spec = json.loads(Path(argv[0]).read_text())
    start = time.perf_counter()
    result = run(spec)
    result["worker_s"] = time.perf_counter() - start
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
