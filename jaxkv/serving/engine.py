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
import os
import time
import warnings
from collections.abc import Iterable, Sequence

import jax

from jaxkv.batch import QUERY_BLOCK
from jaxkv.decoding.model import DecoderModel, check_model
from jaxkv.decoding.sampling import GREEDY, Sampling
from jaxkv.decoding.speculative import DraftModel
from jaxkv.eviction import EvictionSpec
from jaxkv.kernels import TOKENS_LAYOUT, XLA, check_backend, check_layout, resolve_backend
from jaxkv.layers.paged import Paging
from jaxkv.retrieval import RetrievalSpec
from jaxkv.persist import model_identity
from jaxkv.quantization import QuantSpec
from jaxkv.serving.compaction import PageBudget
from jaxkv.serving.disk_link import DiskTier, pool_formats
from jaxkv.serving.draft_proposer import DraftProposer
from jaxkv.serving.input_processor import InputProcessor
from jaxkv.serving.kv_manager import PREEMPTION_MODES, KVCacheManager
from jaxkv.serving.model_runner import ModelRunner, prefill_buckets, step_shapes
from jaxkv.serving.output_processor import OutputProcessor
from jaxkv.serving.parallel_sampling import fork_sequences
from jaxkv.serving.requests import Completion, RequestError, RequestOutput, SequenceState
from jaxkv.serving.scheduler import Chunk, Scheduler
from jaxkv.serving.sizing import PoolSizes, parse_bytes, pool_sizes
from jaxkv.serving.speculation import NgramProposer, Speculation, SpeculationStats, SpeculativeConfig


_SPEC_FIELDS = {"quantization": QuantSpec, "eviction": EvictionSpec, "speculative": SpeculativeConfig,
                "retrieval": RetrievalSpec}  # fmt: skip


def _check_int(name: str, value, *, low: int, optional: bool = False) -> None:
    """``EngineConfig.<name>`` is an int of at least ``low`` (or None if ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"EngineConfig.{name} must be {kind}, got {value!r}")
    if value < low:
        raise ValueError(f"EngineConfig.{name} must be at least {low}, got {value}")


def _check_bytes(name: str, value, low: int) -> None:
    """``EngineConfig.<name>`` is a size (``"1GiB"`` or an int of bytes) of at least ``low`` bytes."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"EngineConfig.{name} must be a size ('1GiB') or an int of bytes, got {value!r}")
    if parse_bytes(value, f"EngineConfig.{name}") < low:
        raise ValueError(f"EngineConfig.{name} must be {'positive' if low else 'not negative'}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes, one line each.

    ``kv_memory``: bytes for the page pools (``"1GiB"``, ``512 * 2**20``); under a mesh, over all
    devices (each holds its share: pages over ``data``, K/V heads over ``model``).
    ``page_size``: tokens per page.
    ``max_num_seqs``: rows running at once (under a mesh a multiple of the ``data`` axis); a step
    that prefills has a decode slot per row, a decode-only step the smallest of the halvings of
    ``max_num_seqs`` down to 8 that holds its rows (``step_shapes``).
    ``max_num_batched_tokens``: prefill-chunk tokens per step besides the decodes (a multiple of
    ``QUERY_BLOCK``; also the largest prefill bucket).
    ``max_model_len``: the longest prompt plus output (default: the model's ``max_position_embeddings``).
    ``prefix_caching``: share the pages of equal prompt prefixes between requests.
    ``max_logprobs``: the most ``logprobs`` a request may ask for (at most the vocabulary: a model
    with fewer tokens takes at most its vocabulary size).
    ``seed``: a request without a seed draws from ``seed + request id``.
    ``quantization``: store the pages quantized (``QuantSpec(nbits=8, residual_length=0)``, fp8
    with ``format="e4m3"``).
    ``eviction``: keep full-attention K/V in a budget of slots per row, evicting by a policy
    (``EvictionSpec``; a ``compression_ratio`` is a fraction of ``max_model_len``): those layers
    take no pages, the engine serves without prefix caching, and each prefill chunk is one
    update of the policy.
    ``host_kv_memory``: bytes of host memory under the page pools (``"512MiB"``; 0: none). Cached
    pages evicted from a pool are demoted there (least recently demoted leave first) and promoted
    back on a prefix hit; preempted sequences may be swapped there (``jaxkv.serving.host_tier``).
    ``preemption``: 'auto' (swap a preempted sequence's pages to the host tier when the cost rule of
    ``jaxkv.serving.kv_manager`` says it pays), 'swap' (whenever the host tier has room) or
    'recompute' (never swap).
    ``kv_cache_dir``: a directory for the disk tier of the prefix cache (None: none). Every page
    the prefix cache registers is saved there once, so an engine started later on the same model
    and page format finds the prefixes (``jaxkv.serving.disk_tier``: keyed by the weights'
    fingerprint, the page format and the salted hash chain; corrupt or foreign files are ignored
    and removed). Needs ``prefix_caching``.
    ``disk_kv_memory``: the disk tier's size limit per pool (``"16GiB"``); the least recently
    used pages leave first.
    ``speculative``: draft tokens proposed for decoding sequences and verified in the step
    (``jaxkv.serving.speculation.SpeculativeConfig``; None: none).
    ``max_pages_per_request``: at most this many pages of the full-attention pool per sequence
    (None: unbounded; at least 2): a sequence that needs one more is compacted first, keeping
    the best ``(max_pages_per_request - 1) * page_size`` tokens by ``compaction_policy``
    (``jaxkv.serving.compaction``: 'streaming_llm', 'key_norm', 'h2o', 'zipage', 'snapkv' or
    'pyramidkv'; all but 'zipage' with ``EvictionSpec``'s defaults; the last four keep each slot's
    attention mass in the pages; 'snapkv' and 'pyramidkv' prefill a prompt longer than the budget
    whole, then compact it once by the attention its last 64 queries give each token), chosen
    for every layer and K/V head of the pool at once or for each on its own
    (``compaction_choice``: 'pool', their mean score, or 'head', ``EvictingLayer``'s choice;
    'pyramidkv', whose layers keep different budgets, needs 'head').
    ``attention_backend``: what reads the paged decode tokens: 'xla' (jaxkv's own reads),
    'pallas_gpu' / 'pallas_tpu' (JAX's Pallas paged-attention kernels; interpreted off their
    platform) or 'auto' (the platform's kernel, else 'xla'); what a kernel lacks (prefill chunks,
    windows, drafts, compacted rows, int pages) is read by XLA (``jaxkv.kernels``, docs/kernels.md).
    ``pool_layout``: how the pages are stored (``Paging.layout``): 'tokens' ``[P, page, H_kv, D]``
    or 'heads' ``[P, H_kv, page, D]``, which the kernels read in place page by page.
    ``retrieval``: page retrieval attention (Quest) over the full-attention pool
    (``jaxkv.retrieval.RetrievalSpec`` with this ``page_size`` and sequential pages): each
    page keeps a summary of its keys and each decode token reads ``budget`` tokens of its row per
    K/V head (sink pages, recent pages and the best scored in between); under ``prefill='dense'``
    prompt tokens read every page (wherever a step packs them: a prompt's last token after a prefix
    hit rides in a decode slot), under 'retrieve' they retrieve too. Every token stays in the pool:
    it saves each step's reads, not pages.
    """

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
    host_kv_memory: int | str = 0
    preemption: str = "auto"
    kv_cache_dir: str | os.PathLike | None = None
    disk_kv_memory: int | str = "16GiB"
    speculative: SpeculativeConfig | None = None
    max_pages_per_request: int | None = None
    compaction_policy: str = "streaming_llm"
    compaction_choice: str = "pool"
    attention_backend: str = XLA
    pool_layout: str = TOKENS_LAYOUT
    retrieval: RetrievalSpec | None = None

    def __post_init__(self):
        self._check_fields()
        if self.max_num_batched_tokens % QUERY_BLOCK:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be a multiple of {QUERY_BLOCK}: prefill "
                f"chunks are packed in blocks of {QUERY_BLOCK} tokens"
            )
        if self.kv_cache_dir is not None and not self.prefix_caching:
            raise ValueError("EngineConfig.kv_cache_dir keeps prefix-cache pages on disk: it needs prefix_caching")
        if self.speculative is not None and self.eviction is not None:
            raise ValueError("EngineConfig.speculative cannot roll back evicting layers: pass eviction=None")
        self._check_page_budget()
        self._check_retrieval()

    def _check_fields(self) -> None:
        """Each field on its own, whether or not the options that use it are set (a compaction
        policy is checked without a page budget, a disk size without a disk directory)."""
        check_backend(self.attention_backend, "EngineConfig.attention_backend")
        check_layout(self.pool_layout, "EngineConfig.pool_layout")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_int(name, getattr(self, name), low=1)
        _check_int("max_model_len", self.max_model_len, low=1, optional=True)
        _check_int("max_logprobs", self.max_logprobs, low=0)
        _check_int("seed", self.seed, low=0)
        _check_int("max_pages_per_request", self.max_pages_per_request, low=2, optional=True)
        if not isinstance(self.prefix_caching, bool):
            raise TypeError(f"EngineConfig.prefix_caching must be a bool, got {self.prefix_caching!r}")
        for name, low in (("kv_memory", 1), ("host_kv_memory", 0), ("disk_kv_memory", 1)):
            _check_bytes(name, getattr(self, name), low)
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"EngineConfig.preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.kv_cache_dir is not None and not (isinstance(self.kv_cache_dir, str | os.PathLike)
                                                  and os.fspath(self.kv_cache_dir)):  # fmt: skip
            raise TypeError(f"EngineConfig.kv_cache_dir must be a directory path or None, got {self.kv_cache_dir!r}")
        PageBudget.check_options(self.compaction_policy, self.compaction_choice)
        for name, spec_type in _SPEC_FIELDS.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, spec_type):
                raise TypeError(f"EngineConfig.{name} must be a {spec_type.__name__} or None, got {type(value).__name__}")

    def _check_retrieval(self) -> None:
        """``retrieval`` is a ``RetrievalSpec`` over this pool's pages, alone among the options that
        rewrite or drop K/V."""
        if self.retrieval is None:
            return
        if self.retrieval.page_size != self.page_size:
            raise ValueError(
                f"EngineConfig.retrieval: the pages it chooses are the pool's: its page_size must be page_size "
                f"({self.page_size}), got {self.retrieval.page_size}"
            )
        clashes = {
            "max_pages_per_request": "compacted pages hold non-contiguous positions",
            "eviction": "evicting layers keep no pages",
            "speculative": "rejected drafts would stay in the page summaries",
        }
        for name, why in clashes.items():
            if getattr(self, name) is not None:
                raise ValueError(f"EngineConfig.retrieval does not combine with {name} ({why}): pass one of the two")

    def _check_page_budget(self) -> None:
        """``max_pages_per_request``, ``compaction_policy`` and ``compaction_choice`` are valid
        (``PageBudget``) and combine with the other options."""
        if self.max_pages_per_request is None:
            return
        self.page_budget()
        if self.speculative is not None:
            raise ValueError(
                "EngineConfig.max_pages_per_request: compacted pages cannot roll back rejected drafts; pass "
                "speculative=None"
            )
        if self.eviction is not None:
            raise ValueError(
                "EngineConfig.max_pages_per_request evicts inside the pages; eviction keeps full-attention K/V "
                "outside them: pass one of the two"
            )

    @property
    def scores_slots(self) -> bool:
        """Do the full-attention pages keep each slot's attention mass (an attention-ranked compaction)?"""
        budget = self.page_budget()
        return budget is not None and budget.scored

    def page_budget(self, max_model_len: int | None = None) -> PageBudget | None:
        """The page budget of ``max_pages_per_request`` (None: none) for sequences of up to
        ``max_model_len`` tokens (the engine's; a prompt prefilled whole may hold that many)."""
        if self.max_pages_per_request is None:
            return None
        return PageBudget(
            self.max_pages_per_request, self.page_size, self.compaction_policy, max_model_len, self.compaction_choice
        )

    def prefill_buckets(self) -> tuple[int, ...]:
        """Sizes of a step's prefill section (``model_runner.prefill_buckets``)."""
        return prefill_buckets(self.max_num_batched_tokens)

    def step_shapes(self) -> tuple[tuple[int, int, int], ...]:
        """The compiled steps' ``(decode slots, prefill size, decode width)`` (``model_runner.step_shapes``)."""
        return step_shapes(self.max_num_seqs, self.max_num_batched_tokens, self.decode_width)

    @property
    def decode_width(self) -> int:
        """Tokens of a decode slot in a step that verifies drafts: ``1 + k`` (1 without speculation)."""
        return 1 if self.speculative is None else 1 + self.speculative.num_tokens


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
        self.runner = ModelRunner(
            model, cache, self.config.max_num_seqs, self.config.max_num_batched_tokens,
            max(1, max_logprobs), self.config.decode_width, budget,
            dense_prompts=self.config.retrieval is not None and self.config.retrieval.prefill == "dense",
        )  # fmt: skip
        prefix_caching = self.config.prefix_caching and not self.has_states
        self.kv = KVCacheManager(
            self.sizes, prefix_caching, parse_bytes(self.config.host_kv_memory, "host_kv_memory"),
            self.config.preemption, self._disk_tier() if prefix_caching else None, budget,
        )  # fmt: skip
        self.scheduler = Scheduler(self.kv, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.speculation = self._speculation()
        self.outputs = OutputProcessor(tokenizer, self.max_model_len)
        self.sequences: dict[int, list[SequenceState]] = {}  # by request id, until ``pop``
        self.next_request_id = 0
        self.peak_pages_used = self.peak_kv_bytes = 0
        self.slots_allocated = self.slots_unused = 0
        self.final_outputs: list[RequestOutput] = []  # aborted or failed sequences, reported by the next step

    def _disk_tier(self) -> DiskTier | None:
        """The disk tier under ``kv_cache_dir`` for this model and these pools' page format, or None."""
        if self.config.kv_cache_dir is None:
            return None
        formats = pool_formats(self.runner.page_formats, page_size=self.config.page_size,
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
        speculative: bool = True,
    ) -> int:
        """Queue a request; returns its id. ``stop_token_ids``: tokens that end it besides the
        model's end-of-sequence tokens (those unless ``ignore_eos``; the stop token is part of
        the output tokens); ``stop``: strings that end it (needs the engine's tokenizer; the
        text ends before them); ``cache_salt``: only requests with the same salt share prefix
        pages; ``seed``: its sequences' random stream, in ``[0, 2**32)`` (default: the engine
        seed plus the request id); ``n``: sequences of the prompt, sharing its pages;
        ``speculative``: False keeps the engine's speculation (``EngineConfig.speculative``) from
        drafting for it.
        Raises ``RequestError`` (a ``ValueError``) naming the argument at fault."""
        request_id = self.next_request_id
        prompt, options = self.inputs.process(
            request_id, prompt_ids, sampling, max_tokens=max_tokens, stop_token_ids=stop_token_ids, stop=stop,
            ignore_eos=ignore_eos, cache_salt=cache_salt, seed=seed, logprobs=logprobs, n=n, speculative=speculative,
        )  # fmt: skip
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
        with jax.profiler.TraceAnnotation("engine.schedule"):
            chunks = self.scheduler.schedule()
            if self.speculation is not None:
                chunks = self.speculation.plan(chunks)
        self._move_pages()  # even without chunks: the pages read may be written later
        if not chunks:
            return self._take_final()
        block_tables = self._block_tables()
        start, compiled = time.perf_counter(), len(self.runner.executables)
        try:
            outputs = self.runner.run(chunks, block_tables, self._row_shifts())
        except Exception as error:  # noqa: BLE001 - reported per request, the engine goes on
            self._fail({chunk.seq.request_id for chunk in chunks}, error)
            return self._take_final()
        if self.speculation is not None and len(self.runner.executables) == compiled:  # a compile is not a step's time
            self.speculation.observe(chunks, time.perf_counter() - start)
        with jax.profiler.TraceAnnotation("engine.outputs"):
            drawn = [self._append(chunk, outputs, slot) for slot, chunk in enumerate(chunks)]
            self.scheduler.computed(chunks, outputs.num_accepted[: len(chunks)])
            self._fork()  # before a first sequence can finish and free its pages
            self._record_usage()
            return self._take_final() + [self._finish(chunk.seq, *new) for chunk, new in zip(chunks, drawn)]

    def _fork(self) -> None:
        """Start the further sequences of ``n > 1`` requests and copy their pages now (after the
        host copies of pages their allocations evicted), so that a child preempted by swap before
        its first step swaps out its copied page."""
        forks = fork_sequences(self.scheduler, self.sequences, not self.has_states)
        for child in forks.children:
            self.outputs.add(child)
        self._move_pages()
        self.runner.copy_pages(forks.copies)

    def _move_pages(self) -> None:
        """Make the copies between the device pools and the host tier decided since the last call,
        then save the pages read for the disk tier."""
        with jax.profiler.TraceAnnotation("engine.move_pages"):
            moves = self.kv.take_moves()
            if moves:
                self.runner.move_pages(moves)
            for key, page in moves.persist:
                self._save(key, page)

    def _save(self, key, page) -> None:
        """Write one prefix page to the disk tier; a failing disk costs a warning, never a request."""
        try:
            self.kv.disk.save(key, page)
        except OSError as error:
            warnings.warn(f"disk tier: a page could not be saved ({type(error).__name__}: {error})", stacklevel=3)

    def _fail(self, request_ids: set[int], error: Exception) -> None:
        """End every sequence of ``request_ids`` with finish reason 'error'."""
        message = f"{type(error).__name__}: {error}"
        for request_id in sorted(request_ids):
            self._end(request_id, "error", message)
        warnings.warn(f"engine step failed for requests {sorted(request_ids)}: {message}", stacklevel=3)

    def _block_tables(self):
        return self.kv.block_tables(self.scheduler.running, self.config.max_num_seqs, self.max_model_len)

    def _row_shifts(self):
        return self.kv.row_shifts(self.scheduler.running, self.config.max_num_seqs)

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
        self.runner.warmup(self._block_tables(), self._row_shifts())
        if self.speculation is not None:
            self.speculation.proposer.warmup()
        if (self.kv.host.capacity or self.kv.disk is not None) and self.kv.pools:
            self.runner.warmup_copies(max(pool.manager.num_pages for pool in self.kv.pools))

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

    def stats(self) -> dict:
        """Counters for metrics and benchmarks (pages, prefix cache, preemptions, compiles)."""
        pools = self.kv.pools
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_steps": self.runner.num_steps,
            "num_compiled": len(self.runner.executables),
            "preemptions": self.scheduler.stats.preemptions,
            "swaps": self.scheduler.stats.swaps,
            "recomputes": self.scheduler.stats.recomputes,
            "compactions": self.kv.num_compactions,
            "prefix_hit_rate": self.scheduler.stats.prefix_hit_rate,
            "page_size": self.config.page_size,
            "page_bytes": sum(pool.page_bytes for pool in pools),
            "pages": {pool.name: pool.manager.usage() for pool in pools},
            "peak_pages_used": self.peak_pages_used,
            "peak_kv_bytes": self.peak_kv_bytes,
            "wasted_slot_fraction": self.slots_unused / self.slots_allocated if self.slots_allocated else 0.0,
            "max_concurrent_tokens": self.sizes.max_concurrent_tokens,
            "tiers": self._tier_stats(),
            "speculation": (SpeculationStats() if self.speculation is None else self.speculation.stats).as_dict(),
        }

    def _tier_stats(self) -> dict:
        """Per tier: pages held now, prefix-cache hits (pages), and for the host tier its bytes
        (held, pinned by swapped sequences, capacity) and what moved each way since start."""
        host, counters, hits = self.kv.host, self.kv.host.counters, self.kv.stats
        return {
            "device": {"pages": self.kv.usage().pages, "cached_pages": sum(p.manager.num_cached for p in self.kv.pools),
                       "hit_pages": hits.device_hit_pages},
            "host": {"pages": host.num_pages, "bytes": host.used, "pinned_bytes": host.pinned_bytes,
                     "capacity_bytes": host.capacity, "hit_pages": hits.host_hit_pages,
                     "pages_in": counters.pages_in, "pages_out": counters.pages_out,
                     "bytes_in": counters.bytes_in, "bytes_out": counters.bytes_out, "dropped_pages": counters.dropped},
            "disk": self._disk_stats(),
        }  # fmt: skip

    def _disk_stats(self) -> dict:
        """The disk tier over its pools: prefix hits (pages), pages and bytes on disk, written and
        read since start, files refused; zeros without one."""
        pools = {} if self.kv.disk is None else self.kv.disk.stats()
        totals = {key: sum(pool[key] for pool in pools.values()) for key in DISK_STAT_KEYS}
        refused = sum(sum(pool["rejected"].values()) for pool in pools.values())
        return {"hit_pages": self.kv.stats.disk_hit_pages, **totals, "refused_files": refused}


# The disk tier's counters ``stats()`` sums over its pools (``DiskPageStore.stats`` and its size).
DISK_STAT_KEYS = ("pages", "bytes", "pages_written", "bytes_written", "pages_read", "bytes_read")


def default_stop_tokens(config) -> frozenset[int]:
    eos = config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
