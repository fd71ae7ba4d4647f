"""The serving engine: requests come and go between steps, K/V live in shared page pools.

    engine = Engine(model, kv_memory="512MiB")
    request_id = engine.add_request(prompt_ids, sampling=Sampling(temperature=0.7), max_tokens=64)
    while engine.has_unfinished():
        for output in engine.step():        # one compiled step: prefill chunks and decodes together
            print(output.request_id, output.new_token_ids, output.finish_reason)

``generate_many`` runs a list of prompts to the end. Every step is one call of one
compiled function (``jaxkv.serving.step``) whose shapes come from a few buckets of packed
tokens: ``warmup`` compiles them all, and no step compiles after it. The host side decides
what each step computes (``jaxkv.serving.scheduler``) and which pages each request owns
(``jaxkv.serving.pages``).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np
from flax import nnx

from jaxkv.decoding.model import DecoderModel, check_model
from jaxkv.decoding.sampling import GREEDY, RowSampling, Sampling
from jaxkv.eviction import EvictionSpec
from jaxkv.layers.paged import QUERY_BLOCK, Paging, table_width
from jaxkv.quantization import QuantSpec
from jaxkv.serving.pages import NULL_PAGE, PageManager, salt_key
from jaxkv.serving.requests import Completion, RequestOptions, RequestOutput, SampleState
from jaxkv.serving.scheduler import Chunk, Pool, Scheduler, chunk_cost
from jaxkv.serving.step import StepInputs, StepOutputs, compiled_step
from jaxkv.serving.sizing import PoolSizes, pool_sizes

MAX_COPIES = 8  # page copies (forks) per pool per step; more forks wait a step


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes. ``kv_memory``: bytes for the page pools (``"1GiB"``, ``512 * 2**20``), over
    all devices for a model sharded over a mesh: each device holds its share (the pages split
    over ``data``, the K/V heads over ``model``, by the model's rules);
    ``max_num_seqs``: rows decoding at once (each step has a decode slot per row; under a mesh a
    multiple of the ``data`` axis, which splits the block-table rows);
    ``max_num_batched_tokens``: prefill-chunk tokens per step besides the decodes (a multiple
    of ``QUERY_BLOCK``; also the largest prefill bucket); ``max_model_len``:
    the longest prompt plus output (default: the model's ``max_position_embeddings``);
    ``max_logprobs``: the most ``logprobs`` a request may ask for; ``quantization``: store the
    pages quantized (``QuantSpec(nbits=8, residual_length=0)``, fp8 with ``format="e4m3"``);
    ``eviction``: keep full-attention K/V in a budget of slots per row, evicting by a policy
    (``EvictionSpec``; a ``compression_ratio`` is a fraction of ``max_model_len``): those
    layers take no pages, the engine serves without prefix caching, and each prefill chunk is
    one update of the policy."""

    kv_memory: int | str = "1GiB"
    page_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None
    prefix_caching: bool = True
    max_logprobs: int = 20
    seed: int = 0
    quantization: QuantSpec | None = None
    eviction: EvictionSpec | None = None

    def __post_init__(self):
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.max_num_batched_tokens % QUERY_BLOCK:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be a multiple of {QUERY_BLOCK}: prefill "
                f"chunks are packed in blocks of {QUERY_BLOCK} tokens"
            )

    def prefill_buckets(self) -> tuple[int, ...]:
        """Sizes of a step's prefill section: 0, then powers of two from ``QUERY_BLOCK`` up to the budget."""
        sizes, size = [0], QUERY_BLOCK
        while size < self.max_num_batched_tokens:
            sizes.append(size)
            size *= 2
        return (*sizes, self.max_num_batched_tokens)


class Engine:
    """Continuous batching over paged K/V for a decoder model (``jaxkv.models``' Llama and
    Gemma 3: full and sliding attention layers)."""

    def __init__(self, model: DecoderModel, config: EngineConfig | None = None, *, tokenizer=None, **options):
        """``options``: ``EngineConfig`` fields (``kv_memory``, ``page_size``, ...), or pass ``config``.
        ``tokenizer``: anything with ``decode(ids) -> str``; needed for stop strings and output text."""
        check_model(model, DecoderModel)
        self.config = config or EngineConfig(**options)
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = self.config.max_model_len or model.config.max_position_embeddings
        self.sizes = pool_sizes(model, self.config, self.max_model_len)
        self.cache = model.init_cache(
            self.config.max_num_seqs, paging=self.paging(self.sizes), quantization=self.config.quantization,
            eviction=self.config.eviction,
        )  # fmt: skip
        # A recurrent state or an evicted row cannot be rebuilt from cached pages or forked from a longer one.
        self.has_states = self.sizes.state_bytes > 0
        if self.has_states and self.config.prefix_caching:
            warnings.warn(
                "this cache keeps per-row state outside the pages (recurrent states of linear-attention layers, or "
                "evicted K/V): the engine serves it without prefix caching; pass prefix_caching=False to silence this",
                stacklevel=2,
            )
        self.scheduler = Scheduler(
            self.pools(self.sizes), self.config.max_num_seqs, self.config.max_num_batched_tokens,
            self.config.prefix_caching and not self.has_states,
        )  # fmt: skip
        self.graphdef, self.state = nnx.split(model)
        self.executables: dict[int, Callable] = {}
        self.samples: dict[int, list[SampleState]] = {}
        self.next_request_id = 0
        self.num_steps = self.peak_pages_used = self.peak_kv_bytes = 0
        self.slots_allocated = self.slots_unused = 0
        self.stop_token_ids = default_stop_tokens(model.config)
        self.pending_copies = self.empty_copies()
        self.aborted: list[SampleState] = []

    # --- construction ---------------------------------------------------------------------------
    def paging(self, sizes: PoolSizes) -> Paging:
        return Paging(
            page_size=self.config.page_size, num_pages=sizes.full_pages or 2, max_length=self.max_model_len,
            sliding_num_pages=sizes.sliding_pages or None, num_tokens=self.config.max_num_seqs,
        )  # fmt: skip

    def pools(self, sizes: PoolSizes) -> list[Pool]:
        pools = []
        if sizes.full_pages:
            pools.append(
                Pool("full", PageManager(sizes.full_pages, self.config.page_size), None, sizes.full_page_bytes)
            )
        if sizes.sliding_pages:
            manager = PageManager(sizes.sliding_pages, self.config.page_size)
            pools.append(Pool("sliding", manager, sizes.window, sizes.sliding_page_bytes))
        return pools

    # --- requests ---------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        sampling: Sampling = GREEDY,
        *,
        max_tokens: int = 16,
        stop_token_ids: Iterable[int] | None = None,
        stop: Sequence[str] | str = (),
        ignore_eos: bool = False,
        cache_salt: str | None = None,
        seed: int | None = None,
        logprobs: int = 0,
        n: int = 1,
    ) -> int:
        """Queue a request; returns its id. ``stop_token_ids``: tokens that end it (default: the
        model's eos unless ``ignore_eos``; the stop token is part of the output tokens);
        ``stop``: strings that end it (needs the engine's tokenizer; the text ends before
        them); ``cache_salt``: only requests with the same salt share prefix pages;
        ``seed``: its samples' random stream (default: the engine seed and the request id);
        ``n``: samples of the prompt, sharing its pages."""
        options = self.request_options(
            prompt_ids, sampling, max_tokens, stop_token_ids, stop, ignore_eos, cache_salt, seed, logprobs, n
        )
        request_id, self.next_request_id = self.next_request_id, self.next_request_id + 1
        first = SampleState(request_id, 0, [int(t) for t in prompt_ids], options, time.perf_counter())
        self.samples[request_id] = [first]
        self.scheduler.waiting.append(first)
        return request_id

    def request_options(
        self, prompt_ids, sampling, max_tokens, stop_token_ids, stop, ignore_eos, cache_salt, seed, logprobs, n
    ) -> RequestOptions:
        """``add_request``'s keywords checked: errors name the argument and the limit."""
        if len(prompt_ids) == 0:
            raise ValueError("add_request: prompt_ids is empty; a request needs at least one prompt token")
        if max_tokens <= 0 or n <= 0:
            raise ValueError(f"add_request: max_tokens and n must be positive, got {max_tokens} and {n}")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"add_request: prompt token ids must be in [0, {vocab})")
        if not 0 <= logprobs <= self.config.max_logprobs:
            raise ValueError(f"add_request: logprobs must be in [0, {self.config.max_logprobs}], got {logprobs}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if stop and self.tokenizer is None:
            raise ValueError("add_request: stop strings need the text: build the Engine with tokenizer=")
        total = len(prompt_ids) + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"add_request: prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) is {total}, past "
                f"max_model_len {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        self.check_fits(len(prompt_ids), total, n)
        stops = self.stop_token_ids if stop_token_ids is None and not ignore_eos else frozenset(stop_token_ids or ())
        return RequestOptions(
            sampling=sampling, max_tokens=max_tokens, stop_token_ids=frozenset(int(t) for t in stops), stop=stop,
            cache_salt=salt_key(cache_salt), seed=self.config.seed + self.next_request_id if seed is None else seed,
            logprobs=logprobs, n=n,
        )  # fmt: skip

    def check_fits(self, num_prompt: int, num_tokens: int, n: int) -> None:
        """Refuse a request the pools could never hold, even alone (its samples share the prompt's full pages)."""
        if n > self.config.max_num_seqs:
            raise ValueError(f"add_request: n={n} samples exceed max_num_seqs={self.config.max_num_seqs} rows")
        for pool in self.scheduler.pools:
            pages = -(-num_tokens // pool.page_size)
            if pool.window is not None:  # what one step reads and writes: the window and a chunk
                pages = min(pages, -(-(pool.window - 1 + self.config.max_num_batched_tokens) // pool.page_size) + 1)
            needed = pages + (n - 1) * max(pages - (num_prompt - 1) // pool.page_size, 1)
            if needed > pool.manager.num_usable:
                raise ValueError(
                    f"add_request: {n} sample(s) of {num_tokens} tokens need {needed} pages of the {pool.name} pool, "
                    f"which holds {pool.manager.num_usable}; raise kv_memory or lower max_tokens"
                )

    def abort(self, request_id: int) -> None:
        """Stop a request now: its pages are freed at once; the next ``step`` reports each of its
        unfinished samples with finish reason 'abort'. Unknown or finished requests are ignored."""
        for sample in self.samples.get(request_id, ()):
            if not sample.finished:
                sample.finish_reason, sample.finish_time = "abort", time.perf_counter()
                self.scheduler.finish(sample)
                self.aborted.append(sample)

    def request_finished(self, request_id: int) -> bool:
        """Have all of a request's samples finished (its later samples exist once the first has
        computed its prompt; an abort before that ends the request)?"""
        samples = self.samples.get(request_id, [])
        if not samples:
            return True
        complete = len(samples) == samples[0].options.n or samples[0].finish_reason == "abort"
        return complete and all(sample.finished for sample in samples)

    def pop(self, request_id: int) -> list[SampleState]:
        """Forget a request (a long-lived server calls this once it has reported a finished one);
        returns its samples. An unfinished request is aborted first."""
        self.abort(request_id)
        self.aborted = [sample for sample in self.aborted if sample.request_id != request_id]
        return self.samples.pop(request_id, [])

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # --- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one compiled step, and return what each touched sample produced."""
        aborted = self.aborted_outputs()
        chunks = self.scheduler.schedule()
        if not chunks:
            return aborted
        outputs = self.run(chunks, self.pending_copies)
        self.scheduler.computed(chunks)
        self.pending_copies = self.fork_samples()  # before a first sample can finish and free its pages
        self.record_usage()
        return aborted + [self.advance(chunk, outputs) for chunk in chunks]

    def run(self, chunks: list[Chunk], copies: dict) -> StepOutputs:
        inputs = self.step_inputs(chunks, copies)
        executable = self.executable(inputs)
        outputs, self.cache = executable(self.state, self.cache, inputs)
        self.num_steps += 1
        return jax.device_get(outputs)

    def executable(self, inputs: StepInputs) -> Callable:
        """The compiled step for this prefill bucket (compiled on first use, or by ``warmup``)."""
        num_tokens = inputs.tokens.shape[0]
        if num_tokens not in self.executables:
            lowered = compiled_step.lower(
                self.graphdef,
                self.state,
                self.cache,
                inputs,
                max(1, self.config.max_logprobs),
                self.config.max_num_seqs,
            )
            self.executables[num_tokens] = lowered.compile()
        return self.executables[num_tokens]

    def warmup(self) -> None:
        """Compile the step for every prefill bucket, so no request waits for a compile."""
        for size in self.config.prefill_buckets():
            self.executable(self.packed([], size, self.empty_copies()))

    def step_inputs(self, chunks: list[Chunk], copies: dict) -> StepInputs:
        prefill = sum(chunk_cost(chunk.count) for chunk in chunks)
        return self.packed(chunks, next(size for size in self.config.prefill_buckets() if size >= prefill), copies)

    def packed(self, chunks: list[Chunk], prefill_size: int, copies: dict) -> StepInputs:
        """The step's tokens: a decode slot per row (single-token chunks), then ``prefill_size``
        slots of prefill chunks, each starting a block of ``QUERY_BLOCK``; the rest padding. With
        each row's tables and sampling."""
        rows = self.config.max_num_seqs
        size = rows + prefill_size
        tokens, positions, token_rows = np.zeros(size, np.int32), np.full(size, -1, np.int32), np.zeros(size, np.int32)
        sample_index, lengths = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        seeds, numbers, counters = np.zeros(rows, np.uint32), np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        row_sampling = [GREEDY] * rows
        decode_slot, prefill_slot = 0, rows
        for chunk in chunks:
            sample, row = chunk.sample, chunk.sample.row
            if chunk.count == 1:
                start, decode_slot = decode_slot, decode_slot + 1
            else:
                start, prefill_slot = prefill_slot, prefill_slot + chunk_cost(chunk.count)
                token_rows[start:prefill_slot] = row  # padding of the chunk's last block: its row too
            end = start + chunk.count
            tokens[start:end] = sample.tokens[chunk.start : chunk.start + chunk.count]
            positions[start:end] = np.arange(chunk.start, chunk.start + chunk.count)
            token_rows[start:end] = row
            sample_index[row], lengths[row] = end - 1, chunk.start + chunk.count
            seeds[row], numbers[row], counters[row] = sample.options.seed, sample.index, len(sample.output)
            row_sampling[row] = sample.options.sampling
        return StepInputs(
            tokens=tokens, positions=positions, token_rows=token_rows, lengths=lengths,
            block_tables={pool.name: self.block_table(pool) for pool in self.scheduler.pools}, copies=copies,
            sample_index=sample_index, seeds=seeds, sample_numbers=numbers, counters=counters,
            sampling=RowSampling.stack(row_sampling),
        )  # fmt: skip

    def block_table(self, pool: Pool) -> np.ndarray:
        """``[R, W]``: each running sample's pages in its row, the null page elsewhere."""
        table = np.full(
            (self.config.max_num_seqs, table_width(self.max_model_len, pool.page_size)), NULL_PAGE, np.int32
        )
        for sample in self.scheduler.running:
            pages = pool.manager.pages(sample.key)
            table[sample.row, : len(pages)] = pages
        return table

    def empty_copies(self) -> dict:
        return {pool.name: np.zeros((MAX_COPIES, 2), np.int32) for pool in self.scheduler.pools}

    # --- samples ----------------------------------------------------------------------------------
    def fork_samples(self) -> dict:
        """Start the further samples (``n > 1``) of requests whose first sample has just computed
        its prompt: each forks from it (sharing its pages; ``Scheduler.fork``) or, when rows,
        pages or this step's copy slots are short, waits to be computed like a new request.
        Returns the page copies ``[K, 2]`` per pool the next step makes first."""
        pools = self.scheduler.pools
        pairs: dict[str, list] = {pool.name: [] for pool in pools}
        for sample in list(self.scheduler.running):
            family = self.samples[sample.request_id]
            while self.awaits_fork(sample):
                child = SampleState(sample.request_id, len(family), sample.prompt, sample.options, sample.arrival)
                family.append(child)
                # A fork copies at most one page per pool; per-row state is recomputed instead.
                room = not self.has_states and all(len(p) < MAX_COPIES for p in pairs.values())
                forked = self.scheduler.fork(sample, child) if room else None
                if forked is None:
                    self.scheduler.waiting.appendleft(child)
                    continue
                for pool, copies in zip(pools, forked):
                    pairs[pool.name] += copies
        copies = self.empty_copies()
        for name, found in pairs.items():
            copies[name][: len(found)] = np.asarray(found, np.int32).reshape(-1, 2)
        return copies

    def awaits_fork(self, sample: SampleState) -> bool:
        """A first sample with its prompt computed, and fewer samples than asked."""
        return (
            sample.index == 0
            and len(self.samples[sample.request_id]) < sample.options.n
            and sample.num_computed >= len(sample.prompt)
        )

    def advance(self, chunk: Chunk, outputs: StepOutputs) -> RequestOutput:
        """Append the token drawn for a chunk that computed its sample's last known token; finish
        the sample if it stops."""
        sample = chunk.sample
        new: list[int] = []
        if chunk.samples_next:
            row = sample.row
            token = int(outputs.tokens[row])
            sample.output.append(token)
            new.append(token)
            sample.logprobs.append(token_logprobs(outputs, row, token, sample.options.logprobs))
            if sample.first_token_time is None:
                sample.first_token_time = time.perf_counter()
            reason = self.finish_reason(sample)
            if reason is not None:
                sample.finish_reason, sample.finish_time = reason, time.perf_counter()
                self.scheduler.finish(sample)
        return self.output(sample, new)

    def finish_reason(self, sample: SampleState) -> str | None:
        """'stop' on a stop token or string (the text is cut before the string), 'length' at
        ``max_tokens`` or the model's length, else None."""
        options = sample.options
        if self.tokenizer is not None:
            sample.text = self.tokenizer.decode(sample.output)
            cut = min((sample.text.find(s) for s in options.stop if s in sample.text), default=-1)
            if cut >= 0:
                sample.text = sample.text[:cut]
                return "stop"
        if sample.output[-1] in options.stop_token_ids:
            return "stop"
        if len(sample.output) >= options.max_tokens or sample.num_tokens >= self.max_model_len:
            return "length"
        return None

    def output(self, sample: SampleState, new: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=sample.request_id, index=sample.index, new_token_ids=new, finished=sample.finished,
            finish_reason=sample.finish_reason, text=sample.text,
            logprobs=sample.logprobs[len(sample.logprobs) - len(new) :], num_prompt_tokens=len(sample.prompt),
            num_cached_tokens=sample.num_cached_tokens,
        )  # fmt: skip

    def aborted_outputs(self) -> list[RequestOutput]:
        """One final output for each sample aborted since the last step."""
        outputs = [self.output(sample, []) for sample in self.aborted]
        self.aborted = []
        return outputs

    # --- convenience and metrics ------------------------------------------------------------------
    def generate_many(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling = GREEDY, **options
    ) -> list[Completion]:
        """Run ``prompts`` (all queued now) to the end; one ``Completion`` per sample, in request order."""
        ids = [self.add_request(prompt, sampling, **options) for prompt in prompts]
        while self.has_unfinished():
            self.step()
        return [completion(sample) for request_id in ids for sample in self.pop(request_id)]

    def record_usage(self) -> None:
        pools = self.scheduler.pools
        self.peak_pages_used = max(self.peak_pages_used, sum(pool.manager.num_used for pool in pools))
        self.peak_kv_bytes = max(self.peak_kv_bytes, sum(pool.manager.num_used * pool.page_bytes for pool in pools))
        allocated, unused = self.scheduler.wasted_slots()
        self.slots_allocated += allocated
        self.slots_unused += unused

    def stats(self) -> dict:
        """Counters for metrics and benchmarks (pages, prefix cache, preemptions, compiles)."""
        pools = self.scheduler.pools
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_steps": self.num_steps,
            "num_compiled": len(self.executables),
            "preemptions": self.scheduler.stats.preemptions,
            "prefix_hit_rate": self.scheduler.stats.prefix_hit_rate,
            "page_size": self.config.page_size,
            "page_bytes": sum(pool.page_bytes for pool in pools),
            "pages": {pool.name: pool.manager.usage() for pool in pools},
            "peak_pages_used": self.peak_pages_used,
            "peak_kv_bytes": self.peak_kv_bytes,
            "wasted_slot_fraction": self.slots_unused / self.slots_allocated if self.slots_allocated else 0.0,
            "max_concurrent_tokens": self.sizes.max_concurrent_tokens,
        }


def token_logprobs(outputs: StepOutputs, row: int, token: int, num_top: int) -> dict:
    top = [(int(t), float(x)) for t, x in zip(outputs.top_tokens[row, :num_top], outputs.top_logprobs[row, :num_top])]
    return {"token": token, "logprob": float(outputs.logprobs[row]), "top": top}


def completion(sample: SampleState) -> Completion:
    return Completion(
        request_id=sample.request_id, index=sample.index, token_ids=list(sample.output), text=sample.text,
        finish_reason=sample.finish_reason or "", logprobs=list(sample.logprobs),
        num_prompt_tokens=len(sample.prompt), num_cached_tokens=sample.num_cached_tokens,
    )  # fmt: skip


def default_stop_tokens(config) -> frozenset[int]:
    eos = config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
