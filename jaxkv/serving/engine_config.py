"""The serving engine's settings: ``EngineConfig``, the one definition of each engine field.

Every field carries its documentation as an attribute docstring, which ``field_docs`` reads:
``jaxkv serve``, ``jaxkv bench serving`` and the scripts generate their command-line flags from
it (``jaxkv.cli.engine_args``), and YAML configs validate it directly (pydantic validates the
dataclass, then its ``__post_init__`` checks each field on its own and their combinations).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import textwrap
from typing import Literal

from pydantic import ConfigDict

from jaxkv.batch import QUERY_BLOCK
from jaxkv.eviction import EvictionSpec
from jaxkv.kernels import BACKENDS, POOL_LAYOUTS, TOKENS_LAYOUT, XLA, check_backend, check_layout
from jaxkv.quantization import QuantSpec
from jaxkv.retrieval import RetrievalSpec
from jaxkv.serving.compaction import COMPACTION_CHOICES, COMPACTION_POLICIES, PageBudget
from jaxkv.serving.kv_manager import PREEMPTION_MODES
from jaxkv.serving.model_runner import prefill_buckets, step_shapes
from jaxkv.serving.sizing import parse_bytes
from jaxkv.serving.speculation import SpeculativeConfig

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
    """Engine sizes and options, each field documented where it is declared (``field_docs``)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # a YAML key that is no field is an error

    kv_memory: int | str = "1GiB"
    """Bytes for the page pools (``"1GiB"``, ``512 * 2**20``); under a mesh, over all devices (each
    holds its share: pages over ``data``, K/V heads over ``model``)."""
    page_size: int = 16
    """Tokens per page."""
    max_num_seqs: int = 16
    """Rows running at once (under a mesh a multiple of the ``data`` axis); a step that prefills has a
    decode slot per row, a decode-only step the smallest of the halvings of ``max_num_seqs`` down to 8
    that holds its rows (``step_shapes``)."""
    max_num_batched_tokens: int = 256
    """Prefill-chunk tokens per step besides the decodes (a multiple of ``QUERY_BLOCK``; also the
    largest prefill bucket)."""
    max_model_len: int | None = None
    """The longest prompt plus output (default: the model's ``max_position_embeddings``)."""
    prefix_caching: bool = True
    """Share the pages of equal prompt prefixes between requests."""
    max_logprobs: int = 20
    """The most ``logprobs`` a request may ask for (at most the vocabulary: a model with fewer tokens
    takes at most its vocabulary size)."""
    seed: int = 0
    """A request without a seed draws from ``seed + request id``."""
    quantization: QuantSpec | None = None
    """Store the pages quantized (``QuantSpec(nbits=8, residual_length=0)``, fp8 with ``format="e4m3"``)."""
    eviction: EvictionSpec | None = None
    """Keep full-attention K/V in a budget of slots per row, evicting by a policy (``EvictionSpec``; a
    ``compression_ratio`` is a fraction of ``max_model_len``): those layers take no pages, the engine
    serves without prefix caching, and each prefill chunk is one update of the policy."""
    host_kv_memory: int | str = 0
    """Bytes of host memory under the page pools (``"512MiB"``; 0: none). Cached pages evicted from a
    pool are demoted there (least recently demoted leave first) and promoted back on a prefix hit;
    preempted sequences may be swapped there (``jaxkv.serving.host_tier``)."""
    preemption: Literal[PREEMPTION_MODES] = "auto"
    """'auto' (swap a preempted sequence's pages to the host tier when the cost rule of
    ``jaxkv.serving.kv_manager`` says it pays), 'swap' (whenever the host tier has room) or
    'recompute' (never swap)."""
    kv_cache_dir: str | os.PathLike | None = None
    """A directory for the disk tier of the prefix cache (None: none). Every page the prefix cache
    registers is saved there once, so an engine started later on the same model and page format
    finds the prefixes (``jaxkv.serving.disk_tier``: keyed by the weights' fingerprint, the page
    format and the salted hash chain; corrupt or foreign files are ignored and removed). Needs
    ``prefix_caching``."""
    disk_kv_memory: int | str = "16GiB"
    """The disk tier's size limit per pool (``"16GiB"``); the least recently used pages leave first."""
    speculative: SpeculativeConfig | None = None
    """Draft tokens proposed for decoding sequences and verified in the step
    (``jaxkv.serving.speculation.SpeculativeConfig``; None: none)."""
    max_pages_per_request: int | None = None
    """At most this many pages of the full-attention pool per sequence (None: unbounded; at least 2):
    a sequence that needs one more is compacted first, keeping the best
    ``(max_pages_per_request - 1) * page_size`` tokens by ``compaction_policy``."""
    compaction_policy: Literal[COMPACTION_POLICIES] = "streaming_llm"
    """What a compaction keeps (``jaxkv.serving.compaction``): 'streaming_llm' (sinks and recent
    tokens), 'key_norm' (low-norm keys), 'h2o', 'zipage' (attention received), 'snapkv' or
    'pyramidkv' (all but 'zipage' with ``EvictionSpec``'s defaults; the last four keep each slot's
    attention mass in the pages; 'snapkv' and 'pyramidkv' prefill a prompt longer than the budget
    whole, then compact it once by the attention its last 64 queries give each token)."""
    compaction_choice: Literal[COMPACTION_CHOICES] = "pool"
    """Who shares a compaction's choice of tokens: 'pool' (every layer and K/V head, by their mean
    score) or 'head' (each layer and K/V head its own: ``EvictingLayer``'s choice; 'pyramidkv',
    whose layers keep different budgets, needs it)."""
    attention_backend: Literal[BACKENDS] = XLA
    """What reads the paged decode tokens: 'xla' (jaxkv's own reads), 'pallas_gpu' / 'pallas_tpu'
    (JAX's Pallas paged-attention kernels; interpreted off their platform), 'cpu' (jaxkv's native
    CPU kernel, which reads the pools in place, prefill chunks too; CPU platform only, and only where
    the kernel library was built) or 'auto' (the platform's kernel, 'cpu' on CPU when built, else
    'xla'); what a kernel lacks (Pallas: prefill chunks, windows, drafts, int pages; every kernel:
    compacted rows, slot scores) is read by XLA (``jaxkv.kernels``, docs/kernels.md)."""
    pool_layout: Literal[POOL_LAYOUTS] = TOKENS_LAYOUT
    """How the pages are stored (``Paging.layout``): 'tokens' ``[P, page, H_kv, D]`` or 'heads'
    ``[P, H_kv, page, D]``, which the kernels read in place page by page."""
    retrieval: RetrievalSpec | None = None
    """Page retrieval attention (Quest) over the full-attention pool (``RetrievalSpec`` with this
    ``page_size`` and sequential pages): each page keeps a summary of its keys and each decode token
    reads ``budget`` tokens of its row per K/V head (sink pages, recent pages and the best scored in
    between); under ``prefill='dense'`` prompt tokens read every page, under 'retrieve' they
    retrieve too. Every token stays in the pool: it saves each step's reads, not pages."""

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
                kind = type(value).__name__
                raise TypeError(f"EngineConfig.{name} must be a {spec_type.__name__} or None, got {kind}")

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



@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstring of each field of dataclass ``cls`` (the string literal right after
    its declaration), whitespace folded to single spaces; a field without one is missing."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for declaration, following in zip(body, body[1:]):
        if isinstance(declaration, ast.AnnAssign) and isinstance(following, ast.Expr):
            text = following.value.value if isinstance(following.value, ast.Constant) else None
            if isinstance(text, str):
                docs[declaration.target.id] = " ".join(text.split())
    return docs
