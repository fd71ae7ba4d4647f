"""Model running: a step's chunks packed into the compiled step's inputs (nano-vllm's
``ModelRunner.prepare_*``), one executable per prefill bucket, and the step run on the device.

A step's tokens: a decode slot per row (single-token chunks) first, then ``prefill_size``
slots of prefill chunks, each starting a block of ``QUERY_BLOCK`` tokens (the unit paged
attention reads), the rest padding. ``prefill_size`` is the smallest bucket that holds the
step's chunks: ``warmup`` compiles every bucket, and no step compiles after it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from jaxkv.batch import QUERY_BLOCK, PackedBatch
from jaxkv.decoding.sampling import GREEDY, RowSampling
from jaxkv.serving.scheduler import Chunk, chunk_cost
from jaxkv.serving.step import StepInputs, StepOutputs, compiled_step, copy_pages


def prefill_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Sizes of a step's prefill section: 0, then powers of two from ``QUERY_BLOCK`` up to the budget."""
    sizes, size = [0], QUERY_BLOCK
    while size < max_num_batched_tokens:
        sizes.append(size)
        size *= 2
    return (*sizes, max_num_batched_tokens)


class ModelRunner:
    """The model's parameters and paged cache on the device, and the compiled steps over them.
    ``num_rows``: decode slots (the engine's rows); ``num_top``: top log-probabilities computed
    per row (at least 1)."""

    def __init__(self, model, cache, num_rows: int, max_num_batched_tokens: int, num_top: int):
        self.graphdef, self.state = nnx.split(model)
        self.cache = cache
        self.num_rows = num_rows
        self.buckets = prefill_buckets(max_num_batched_tokens)
        self.num_top = num_top
        self.executables: dict[int, Callable] = {}
        self.num_steps = 0

    def run(self, chunks: list[Chunk], block_tables: dict[str, np.ndarray], copies: dict) -> StepOutputs:
        """Copy a fork's pages (``copies``: ``(source, destination)`` pairs per pool name, if any),
        then run one step over ``chunks``; returns the outputs on the host."""
        if any(copies.values()):
            self.cache = copy_pages(self.cache, {name: np.asarray(pairs, np.int32) for name, pairs in copies.items()})
        inputs = self.prepare(chunks, block_tables)
        outputs, self.cache = self._executable(inputs)(self.state, self.cache, inputs)
        self.num_steps += 1
        return jax.device_get(outputs)

    def warmup(self, block_tables: dict[str, np.ndarray]) -> None:
        """Compile the step for every prefill bucket, so no request waits for a compile."""
        for size in self.buckets:
            self._executable(self._packed([], size, block_tables))

    def prepare(self, chunks: list[Chunk], block_tables: dict[str, np.ndarray]) -> StepInputs:
        """The step's inputs in the smallest prefill bucket that holds ``chunks``."""
        prefill = sum(chunk_cost(chunk.count) for chunk in chunks)
        return self._packed(chunks, next(size for size in self.buckets if size >= prefill), block_tables)

    def _executable(self, inputs: StepInputs) -> Callable:
        """The compiled step for this prefill bucket (compiled on first use, or by ``warmup``)."""
        num_tokens = inputs.tokens.shape[0]
        if num_tokens not in self.executables:
            lowered = compiled_step.lower(self.graphdef, self.state, self.cache, inputs, self.num_top)
            self.executables[num_tokens] = lowered.compile()
        return self.executables[num_tokens]

    def _packed(self, chunks: list[Chunk], prefill_size: int, block_tables: dict[str, np.ndarray]) -> StepInputs:
        """A decode slot per row, then ``prefill_size`` slots of prefill chunks, each starting a
        query block; with each row's sampling."""
        rows = self.num_rows
        size = rows + prefill_size
        tokens, positions, token_rows = np.zeros(size, np.int32), np.full(size, -1, np.int32), np.zeros(size, np.int32)
        sample_index, num_logprobs = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        seeds, numbers, counters = np.zeros(rows, np.uint32), np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        row_sampling = [GREEDY] * rows
        decode_slot, prefill_slot = 0, rows
        for chunk in chunks:
            seq, row = chunk.seq, chunk.seq.row
            if chunk.count == 1:
                start, decode_slot = decode_slot, decode_slot + 1
            else:
                start, prefill_slot = prefill_slot, prefill_slot + chunk_cost(chunk.count)
                token_rows[start:prefill_slot] = row  # padding of the chunk's last block: its row too
            end = start + chunk.count
            tokens[start:end] = seq.tokens[chunk.start : chunk.start + chunk.count]
            positions[start:end] = np.arange(chunk.start, chunk.start + chunk.count)
            token_rows[start:end] = row
            sample_index[row], num_logprobs[row] = end - 1, seq.options.logprobs
            seeds[row], numbers[row], counters[row] = seq.options.seed, seq.index, len(seq.output)
            row_sampling[row] = seq.options.sampling
        # A prefill chunk fills at most what the decode slots leave: the rows' [R, T] layout's T.
        packed = PackedBatch(token_rows, block_tables, single_tokens=rows, tokens_per_row=max(1, prefill_size))
        return StepInputs(
            tokens=tokens, positions=positions, packed=packed, sample_index=sample_index, num_logprobs=num_logprobs,
            seeds=seeds, sample_numbers=numbers, counters=counters, sampling=RowSampling.stack(row_sampling),
        )  # fmt: skip
