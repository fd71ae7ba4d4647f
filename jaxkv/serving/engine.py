"""The serving engine: requests come and go between steps, K/V live in shared page pools.

    engine = Engine(model, kv_memory="512MiB")
    request_id = engine.add_request(prompt_ids, sampling=Sampling(temperature=0.7), max_tokens=64)
    while engine.has_unfinished():
        for output in engine.step():        # one compiled step: prefill chunks and decodes together
            print(output.request_id, output.new_token_ids, output.finish_reason)

A request passes through named stages, one module each (vLLM's and nano-vllm's split):
input processing checks it (``input_processor``); each ``step`` schedules the next tokens
(``scheduler``, policy only), whose pages the KV manager grants (``kv_manager`` over
``pages``); the model runner packs and runs them (``model_runner`` over the compiled
``step``); output processing appends the drawn tokens, decodes the text incrementally and
checks stops (``output_processor``, ``detokenizer``); parallel sampling forks a request's
further sequences (``parallel_sampling``). ``generate_many`` runs a list of prompts to the end.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence

import jax

from jaxkv.decoding.model import DecoderModel, check_model
from jaxkv.decoding.sampling import GREEDY, Sampling
from jaxkv.decoding.speculative import DraftModel
from jaxkv.kernels import resolve_backend
from jaxkv.layers.paged import Paging
from jaxkv.persist import model_identity
from jaxkv.serving.disk_link import DiskTier, pool_formats
from jaxkv.serving.draft_proposer import DraftProposer
from jaxkv.serving.engine_config import EngineConfig
from jaxkv.serving.input_processor import InputProcessor
from jaxkv.serving.kv_manager import KVCacheManager
from jaxkv.serving.model_runner import ModelRunner
from jaxkv.serving.output_processor import OutputProcessor
from jaxkv.serving.parallel_sampling import fork_sequences
from jaxkv.serving.plan import StepPlan, plan_step
from jaxkv.serving.requests import Completion, RequestError, RequestOptions, RequestOutput, SequenceState
from jaxkv.serving.scheduler import Chunk, Scheduler
from jaxkv.serving.sizing import PoolSizes, parse_bytes, pool_sizes
from jaxkv.serving.speculation import NgramProposer, Speculation, SpeculationStats
from jaxkv.serving.stats import EngineStats
from jaxkv.serving.step import StepOutputs, page_formats


class Engine:
    """Continuous batching over paged K/V for a decoder model (``jaxkv.models``' Llama,
    Gemma 3 and Qwen3.5: full and sliding attention layers, recurrent states)."""

    def __init__(self, model: DecoderModel, config: EngineConfig | None = None, *, tokenizer=None, **options):
        """``options``: ``EngineConfig`` fields (``kv_memory``, ``page_size``, ...), or pass ``config``.
        ``tokenizer``: anything with ``decode(ids) -> str``; needed for stop strings and output text."""
        check_model(model, DecoderModel)
        self.config = config or EngineConfig(**options)
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = self.config.max_model_len or model.config.max_position_embeddings
        self.sizes = pool_sizes(model, self.config, self.max_model_len)
        budget = self.config.page_budget(self.max_model_len)
        if budget is not None and not self.sizes.full_pages:
            raise ValueError("EngineConfig.max_pages_per_request bounds the full-attention pool: this model has none")
        if self.config.retrieval is not None and not self.sizes.full_pages:
            raise ValueError("EngineConfig.retrieval reads the full-attention pool: this model has none")
        # A recurrent state or an evicted row cannot be rebuilt from cached pages or forked from a longer one.
        self.has_states = self.sizes.state_bytes > 0
        if self.has_states and self.config.prefix_caching:
            warnings.warn(
                "this cache keeps per-row state outside the pages (recurrent states of linear-attention layers, or "
                "evicted K/V): the engine serves it without prefix caching; pass prefix_caching=False to silence this",
                stacklevel=2,
            )
        # A request may ask for at most every token of the vocabulary as alternatives.
        max_logprobs = min(self.config.max_logprobs, model.config.vocab_size)
        self.inputs = InputProcessor(
            model.config.vocab_size, self.max_model_len, max_logprobs, default_stop_tokens(model.config),
            tokenizer is not None, self.config.seed,
        )  # fmt: skip
        cache = model.init_cache(
            self.config.max_num_seqs, paging=self._paging(self.sizes), quantization=self.config.quantization,
            eviction=self.config.eviction, rollback_slots=self.config.decode_width - 1,
        )  # fmt: skip
        prefix_caching = self.config.prefix_caching and not self.has_states
        self.kv = KVCacheManager(
            self.sizes, prefix_caching, parse_bytes(self.config.host_kv_memory, "host_kv_memory"),
            self.config.preemption, self._disk_tier(page_formats(cache)) if prefix_caching else None, budget,
        )  # fmt: skip
        self.runner = ModelRunner(
            model, cache, self.config.max_num_seqs, self.kv.table_widths(self.max_model_len),
            self.config.max_num_batched_tokens, max(1, max_logprobs), self.config.decode_width, budget,
            dense_prompts=self.config.retrieval is not None and self.config.retrieval.prefill == "dense",
        )  # fmt: skip
        self.scheduler = Scheduler(self.kv, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.speculation = self._speculation()
        self.outputs = OutputProcessor(tokenizer, self.max_model_len)
        self.sequences: dict[int, list[SequenceState]] = {}  # by request id, until ``pop``
        self.next_request_id = 0
        self.peak_pages_used = self.peak_kv_bytes = 0
        self.slots_allocated = self.slots_unused = 0
        self.final_outputs: list[RequestOutput] = []  # aborted or failed sequences, reported by the next step

    def _disk_tier(self, group_formats) -> DiskTier | None:
        """The disk tier under ``kv_cache_dir`` for this model and its pools' page format (their paged
        groups' ``page_formats``), or None."""
        if self.config.kv_cache_dir is None:
            return None
        formats = pool_formats(group_formats, page_size=self.config.page_size,
                               quantization=self.config.quantization, layout=self.config.pool_layout)  # fmt: skip
        return DiskTier(self.config.kv_cache_dir, identity=model_identity(self.model), formats=formats,
                        max_bytes=parse_bytes(self.config.disk_kv_memory, "disk_kv_memory"))  # fmt: skip

    def _speculation(self) -> Speculation | None:
        """The speculation stage of ``config.speculative`` (None: none)."""
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            proposer = NgramProposer(spec.max_ngram, spec.min_ngram)
        else:
            DraftModel(spec.draft_model).check(self.model)
            proposer = DraftProposer(
                spec.draft_model, num_rows=self.config.max_num_seqs, max_model_len=self.max_model_len,
                num_tokens=spec.num_tokens, page_size=self.config.page_size,
            )  # fmt: skip
        return Speculation(spec, proposer, self.kv, self.max_model_len, self.runner.step_shape)

    def _paging(self, sizes: PoolSizes) -> Paging:
        return Paging(
            page_size=self.config.page_size, num_pages=sizes.full_pages or 2, max_length=self.max_model_len,
            sliding_num_pages=sizes.sliding_pages or None, scored=self.config.scores_slots,
            compacted=self.config.max_pages_per_request is not None,
            attention_backend=resolve_backend(self.config.attention_backend), layout=self.config.pool_layout,
            retrieval=self.config.retrieval,
        )  # fmt: skip

    # --- requests ---------------------------------------------------------------------------------
    def add_request(
        self, prompt_ids: Sequence[int], sampling: Sampling = GREEDY, options: RequestOptions | None = None, **fields
    ) -> int:
        """Queue a request; returns its id. ``options``: its ``RequestOptions`` (what each field
        asks: ``jaxkv.serving.requests``), or their fields as keywords (``max_tokens=64``, with
        ``sampling`` positional); not both.
        Raises ``RequestError`` (a ``ValueError``) naming the field at fault."""
        if options is None:
            options = RequestOptions(sampling, **fields)
        elif fields or sampling is not GREEDY:
            raise TypeError("add_request: pass options=RequestOptions(...) or its fields as keywords, not both")
        return self._add(prompt_ids, options)

    def _add(self, prompt_ids: Sequence[int], options: RequestOptions) -> int:
        request_id = self.next_request_id
        prompt, options = self.inputs.process(request_id, prompt_ids, options)
        n = options.n
        if n > self.config.max_num_seqs:
            raise RequestError(f"add_request: n={n} sequences exceed max_num_seqs={self.config.max_num_seqs} rows", "n")
        self.kv.check_fits(len(prompt), len(prompt) + options.max_tokens, n, self.config.max_num_batched_tokens)
        self.next_request_id += 1
        first = SequenceState(request_id, 0, prompt, options, time.perf_counter())
        self.sequences[request_id] = [first]
        self.outputs.add(first)
        self.scheduler.waiting.append(first)
        return request_id

    def abort(self, request_id: int) -> None:
        """Stop a request now: its pages are freed at once; the next ``step`` reports each of its
        unfinished sequences with finish reason 'abort' (``has_unfinished`` stays True until
        then). Unknown or finished requests are ignored."""
        self._end(request_id, "abort")

    def _end(self, request_id: int, reason: str, error: str | None = None) -> None:
        for seq in self.sequences.get(request_id, ()):
            if not seq.finished:
                self._close(seq, reason)
                self.final_outputs.append(self.outputs.output(seq, [], error))

    def _close(self, seq: SequenceState, reason: str) -> None:
        """Finish ``seq`` with ``reason``: its text completed, its pages and row freed."""
        self.outputs.finished(seq, reason)
        self.scheduler.finish(seq)
        if self.speculation is not None:
            self.speculation.release(seq)

    def request_finished(self, request_id: int) -> bool:
        """Have all of a request's sequences finished (its later sequences exist once the first
        has computed its prompt; an abort or error before that ends the request)?"""
        family = self.sequences.get(request_id, [])
        if not family:
            return True
        complete = len(family) == family[0].options.n or family[0].finish_reason in ("abort", "error")
        return complete and all(seq.finished for seq in family)

    def pop(self, request_id: int) -> list[SequenceState]:
        """Forget a request (a long-lived server calls this once it has reported a finished one);
        returns its sequences. An unfinished request is aborted first."""
        self.abort(request_id)
        self.final_outputs = [output for output in self.final_outputs if output.request_id != request_id]
        family = self.sequences.pop(request_id, [])
        for seq in family:
            self.outputs.forget(seq)
        return family

    def has_unfinished(self) -> bool:
        """Is there work or an unreported output (an abort) for the next ``step``?"""
        return bool(self.scheduler.waiting or self.scheduler.running or self.final_outputs)

    # --- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one compiled step, process its outputs. A failure while the step is
        prepared or run fails the requests it held, each with finish reason 'error' and the
        error's message; the engine takes the next request as before."""
        plan = self._schedule()
        outputs = self._run(plan)
        return self._take_final() if outputs is None else self._process(plan, outputs)

    def _schedule(self) -> StepPlan:
        """This step's plan (``jaxkv.serving.plan``): the scheduler's chunks, with the drafts
        speculation gives them, and what changed in the pages since the last plan."""
        with jax.profiler.TraceAnnotation("engine.schedule"):
            chunks = self.scheduler.schedule()
            if self.speculation is not None:
                chunks = self.speculation.plan(chunks)
            return plan_step(self.scheduler, chunks)

    def _run(self, plan: StepPlan) -> StepOutputs | None:
        """Apply ``plan`` (even without chunks: the pages read may be written later), then run its
        chunks; their outputs, or None when nothing ran (no chunks, or the step failed: its
        requests were failed)."""
        self._apply(plan)
        if not plan.chunks:
            return None
        start, compiled = time.perf_counter(), len(self.runner.executables)
        try:
            outputs = self.runner.run(plan.chunks)
        except Exception as error:  # noqa: BLE001 - reported per request, the engine goes on
            self._fail({chunk.seq.request_id for chunk in plan.chunks}, error)
            return None
        if self.speculation is not None and len(self.runner.executables) == compiled:  # a compile is not a step's time
            self.speculation.observe(plan.chunks, time.perf_counter() - start)
        return outputs

    def _process(self, plan: StepPlan, outputs: StepOutputs) -> list[RequestOutput]:
        """Append each chunk's drawn tokens, advance the sequences, fork, finish the stopped ones;
        the step's outputs."""
        with jax.profiler.TraceAnnotation("engine.outputs"):
            chunks = plan.chunks
            drawn = [self._append(chunk, outputs, slot) for slot, chunk in enumerate(chunks)]
            self.scheduler.computed(chunks, outputs.num_accepted[: len(chunks)])
            self._fork()  # before a first sequence can finish and free its pages
            self._record_usage()
            return self._take_final() + [self._finish(chunk.seq, *new) for chunk, new in zip(chunks, drawn)]

    def _fork(self) -> None:
        """Start the further sequences of ``n > 1`` requests and copy their pages now, in a plan of
        their own (after the host copies of pages their allocations evicted), so that a child
        preempted by swap before its first step swaps out its copied page."""
        forks = fork_sequences(self.scheduler, self.sequences, not self.has_states)
        for child in forks.children:
            self.outputs.add(child)
        self._apply(plan_step(self.scheduler, copies=forks.copies))

    def _apply(self, plan: StepPlan) -> None:
        """Make ``plan``'s page moves and copies and write its block-table rows
        (``ModelRunner.apply``), then save the pages read for the disk tier."""
        with jax.profiler.TraceAnnotation("engine.apply"):
            self.runner.apply(plan)
            self.kv.persist(plan.moves)

    def _fail(self, request_ids: set[int], error: Exception) -> None:
        """End every sequence of ``request_ids`` with finish reason 'error'."""
        message = f"{type(error).__name__}: {error}"
        for request_id in sorted(request_ids):
            self._end(request_id, "error", message)
        warnings.warn(f"engine step failed for requests {sorted(request_ids)}: {message}", stacklevel=3)

    def _take_final(self) -> list[RequestOutput]:
        final, self.final_outputs = self.final_outputs, []
        return final

    def _append(self, chunk: Chunk, outputs, slot: int) -> tuple[list[int], str | None]:
        """Append the tokens made in sample ``slot`` for a chunk that computed its sequence's last
        known token: its accepted drafts and the token drawn after them, up to a stop. Returns
        them and the finish reason (None: it goes on)."""
        seq, new, reason = chunk.seq, [], None
        if not chunk.draws_next:
            return new, reason
        accepted = int(outputs.num_accepted[slot])
        if self.speculation is not None:
            self.speculation.verified(chunk, accepted)
        for j in range(accepted + 1):
            new.append(int(outputs.tokens[slot, j]))
            reason = self.outputs.append(
                seq, new[-1], outputs.logprobs[slot, j], outputs.top_tokens[slot, j], outputs.top_logprobs[slot, j]
            )
            if reason is not None:
                break
        return new, reason

    def _finish(self, seq: SequenceState, new: list[int], reason: str | None) -> RequestOutput:
        """The step's output for ``seq``, finishing it if ``reason``."""
        if reason is not None:
            self._close(seq, reason)
        return self.outputs.output(seq, new)

    def warmup(self) -> None:
        """Compile the step for every step shape (and, with a host or disk tier, its page copies for
        every bucket up to a pool's size), so no request waits for a compile."""
        self.runner.warmup()
        if self.speculation is not None:
            self.speculation.proposer.warmup()
        pages = self.kv.copied_pages()
        if pages:
            self.runner.warmup_copies(pages)

    # --- convenience and metrics ------------------------------------------------------------------
    def generate_many(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling = GREEDY, **options
    ) -> list[Completion]:
        """Run ``prompts`` (all queued now) to the end; one ``Completion`` per sequence, in request order."""
        ids = [self.add_request(prompt, sampling, **options) for prompt in prompts]
        while self.has_unfinished():
            self.step()
        family = [seq for request_id in ids for seq in self.sequences[request_id]]
        completions = [self.outputs.completion(seq) for seq in family]
        for request_id in ids:
            self.pop(request_id)
        return completions

    def _record_usage(self) -> None:
        usage = self.kv.usage()
        self.peak_pages_used = max(self.peak_pages_used, usage.pages)
        self.peak_kv_bytes = max(self.peak_kv_bytes, usage.bytes)
        allocated, unused = self.kv.wasted_slots(self.scheduler.running)
        self.slots_allocated += allocated
        self.slots_unused += unused

    def stats(self) -> EngineStats:
        """A snapshot of the engine's statistics (``jaxkv.serving.stats``): its sequences, steps and
        compiles, preemptions and compactions, and the KV manager's pages, prefix cache and tiers."""
        scheduled = self.scheduler.stats
        speculation = SpeculationStats() if self.speculation is None else dataclasses.replace(self.speculation.stats)
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_steps=self.runner.num_steps, num_compiled=len(self.runner.executables),
            preemptions=scheduled.preemptions, swaps=scheduled.swaps, recomputes=scheduled.recomputes,
            compactions=self.kv.num_compactions, prefix_cache=self.kv.prefix_stats(), page_size=self.config.page_size,
            pages=self.kv.pool_stats(), peak_pages_used=self.peak_pages_used, peak_kv_bytes=self.peak_kv_bytes,
            wasted_slot_fraction=self.slots_unused / self.slots_allocated if self.slots_allocated else 0.0,
            max_concurrent_tokens=self.sizes.max_concurrent_tokens, **self.kv.tier_stats(), speculation=speculation,
        )  # fmt: skip


def default_stop_tokens(config) -> frozenset[int]:
    eos = config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
