"""The tasks of ``jaxkv experiment`` (``jaxkv.research.experiment``): what one cell of a grid measures on
one model through one cache.

* ``perplexity``: windows of the packaged corpus (``jaxkv.research.corpus``, the Lee news articles) fed
  through the cache in chunks, so every prediction after the first chunk reads what the cache kept
  (quantized codes, or the slots an eviction policy left).
* ``passkey``: a haystack of corpus sentences with one sentence stating a random 5-digit pass key
  at a given depth (fraction of the haystack's tokens), then the question; greedy decoding must
  reproduce the digits.
* ``kv_retrieval``: several "special magic number for WORD is: NUMBER" facts (random words and
  numbers) at random depths in the same haystack, the asked one at a given depth; exact match of
  the asked number.
* ``mqar``: multi-query associative recall of a small transformer trained from scratch
  (``jaxkv.research.mqar``), through the cache.

The retrieval prompts are split as kvpress evaluates its presses: the context (instruction and
haystack, inside the chat template where the model has one) is prefilled first, which is where an
evicting cache compresses it, and the question with the start of the answer ("The pass key is:") is
fed afterwards through what was kept. The question cannot steer what is kept (query-agnostic
compression), which is the harder and the published setting. Each batch of contexts is prefilled
once for every cache of its cells (``ContextPrefills``): the plain cache, each quantized format and
each policy at each budget compress the same prefill.

Examples depend on the task, the tokenizer, the context length and the seed only, so every cache
of a grid answers the same prompts.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import Field, PositiveInt, model_validator

from jaxkv.config import Strict, load_config
from jaxkv.eviction import EvictionSpec
from jaxkv.research.corpus import corpus_text
from jaxkv.research.observer import Observer, refill

Depth = Annotated[float, Field(ge=0.0, le=1.0)]

# Keys of the kv_retrieval facts: short, common, distinct words.
KEY_WORDS = (
    "apple", "river", "candle", "tiger", "garden", "window", "silver", "rabbit", "pencil", "orange", "castle",
    "forest", "hammer", "island", "jacket", "lemon", "mirror", "needle", "ocean", "pepper", "rocket", "saddle",
    "turtle", "violin", "wagon", "yellow", "anchor", "bottle", "cherry", "dragon", "feather", "guitar", "helmet",
    "kettle", "ladder", "marble", "noodle", "parrot", "quartz", "ribbon",
)  # fmt: skip


class Task(Strict):
    """What every task has: a ``name`` in the grid's cells (default: its kind), needed when one
    kind appears twice with different settings."""

    name: str | None = None

    @property
    def label(self) -> str:
        return self.name or self.kind

    def prompt_length(self, context: int) -> int | None:
        """The tokens a cell's cache compresses in its first update when every row has as many
        (PyramidKV plans its per-layer budgets for them, ``EvictionSpec.prompt_length``); None where
        the rows' contexts differ in length (the retrieval tasks) or arrive in chunks (perplexity):
        the schedule is then planned for the cache's ``context`` tokens."""
        return None


class PerplexityTask(Task):
    """Perplexity of ``windows`` windows of ``context`` + 1 corpus tokens per seed (seed s reads the
    windows after seed s - 1's; seed 0's first window is the one the old perplexity script read),
    fed through the cache in ``chunk``-token updates: each chunk attends over itself and what the
    cache kept of the chunks before it. With ``chunk`` equal to a quantized cache's residual (128), a query sees the
    keys that decoding token by token would."""

    kind: Literal["perplexity"]
    contexts: Annotated[list[PositiveInt], Field(min_length=1)] = [1024, 2048]
    chunk: PositiveInt = 128
    windows: PositiveInt = 1  # rows of one forward

    metric: ClassVar[str] = "perplexity"

    @model_validator(mode="after")
    def _chunks_tile_the_window(self):
        for context in self.contexts:
            if context % self.chunk:
                raise ValueError(f"context {context} is not a multiple of chunk {self.chunk}; the chunks must tile it")
        return self

    def prepare(self, tokenizer) -> np.ndarray:
        """The corpus as token ids ``[N]`` (with the tokenizer's BOS, if it adds one)."""
        return np.asarray(tokenizer.encode(corpus_text()), np.int32)

    def run(self, model, tokenizer, ids: np.ndarray, context: int, seed: int, cache_options: dict):
        """The cell's metrics and the K/V bytes per row (see ``perplexity_metrics``)."""
        return perplexity_metrics(model, ids, self, context, seed, cache_options)


class RetrievalTask(Task):
    """A needle task over the corpus haystack: ``examples`` builds the prompts of a cell, greedy
    answers are scored by ``retrieval_metrics``."""

    @abc.abstractmethod
    def build_examples(self, tokenizer, chat: bool, haystack: Haystack, context: int, seed: int):
        """The cell's prompts and answers (``chat``: in the model's chat template)."""

    def prepare(self, tokenizer) -> RetrievalData:
        return RetrievalData(Haystack.build(tokenizer), ContextPrefills())

    def run(self, model, tokenizer, data: RetrievalData, context: int, seed: int, cache_options: dict):
        """The cell's metrics and the K/V bytes per row (see ``retrieval_metrics``)."""
        examples = self.build_examples(tokenizer, tokenizer.chat_template is not None, data.haystack, context, seed)
        return retrieval_metrics(
            model, tokenizer, examples, context=context, max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size, cache_options=cache_options, prefills=data.prefills, seed=seed,
        )  # fmt: skip


class PasskeyTask(RetrievalTask):
    """A 5-digit pass key stated at each of ``depths`` (fraction of the haystack) in ``examples``
    haystacks per depth and seed; the prompt (context, question and ``max_new_tokens`` answer
    tokens) fits each of ``contexts`` tokens. ``batch_size`` examples share one forward."""

    kind: Literal["passkey"]
    contexts: Annotated[list[PositiveInt], Field(min_length=1)] = [1024, 2048, 4096]
    depths: Annotated[list[Depth], Field(min_length=1)] = [0.1, 0.5, 0.9]
    examples: PositiveInt = 1  # per depth and seed
    batch_size: PositiveInt = 4
    max_new_tokens: PositiveInt = 8

    metric: ClassVar[str] = "accuracy"

    def build_examples(self, tokenizer, chat: bool, haystack: Haystack, context: int, seed: int):
        return passkey_examples(self, tokenizer, chat, haystack, context, seed)


class KVRetrievalTask(RetrievalTask):
    """``facts`` "WORD -> NUMBER" facts per haystack: the asked one at each of ``depths``, the others
    at random depths; otherwise as ``passkey``."""

    kind: Literal["kv_retrieval"]
    contexts: Annotated[list[PositiveInt], Field(min_length=1)] = [1024, 2048, 4096]
    depths: Annotated[list[Depth], Field(min_length=1)] = [0.1, 0.5, 0.9]
    facts: Annotated[int, Field(ge=1, le=len(KEY_WORDS))] = 4
    examples: PositiveInt = 1
    batch_size: PositiveInt = 4
    max_new_tokens: PositiveInt = 10

    metric: ClassVar[str] = "accuracy"

    def build_examples(self, tokenizer, chat: bool, haystack: Haystack, context: int, seed: int):
        return kv_retrieval_examples(self, tokenizer, chat, haystack, context, seed)


class MQARTask(Task):
    """Multi-query associative recall of the model trained into ``checkpoint`` (a directory
    ``jaxkv train-mqar`` wrote; ``jaxkv.research.mqar.evaluate``): ``examples`` fresh examples per seed,
    ``batch_size`` per forward. The model is the checkpoint's (the grid's ``models`` do not apply)
    and the context is its ``2 * num_pairs`` tokens: budgets are fractions of it. Besides the
    accuracy, the metrics trace each error to whether its pair's tokens were evicted."""

    kind: Literal["mqar"]
    checkpoint: str
    # The training config of the checkpoint: its context sizes the budgets, and a missing
    # checkpoint is trained from it on first use (the grid then runs with one command).
    train_config: str | None = None
    examples: PositiveInt = 512
    batch_size: PositiveInt = 256

    metric: ClassVar[str] = "accuracy"

    def training_config(self):
        """The ``MQARConfig`` the checkpoint was (or will be) trained with."""
        from jaxkv.research.mqar import CONFIG_FILE, MQARConfig

        config_file = Path(self.checkpoint) / CONFIG_FILE
        if config_file.is_file():
            return MQARConfig.model_validate_json(config_file.read_text())
        if self.train_config is None:
            raise ValueError(
                f"mqar checkpoint {self.checkpoint}: {config_file} does not exist; train one with "
                f"`jaxkv train-mqar configs/mqar.yaml --output {self.checkpoint}`, or give the task a train_config"
            )
        return load_config(self.train_config, MQARConfig)

    @property
    def contexts(self) -> list[int]:
        """The checkpoint's context length."""
        return [self.training_config().data.context_length]

    def prompt_length(self, context: int) -> int:
        """The context (``2 * num_pairs`` tokens, every example's) is prefilled and compressed in one
        update before the queries: kvpress's prompt, whatever the queries add to the cache."""
        return context

    def load(self):
        from jaxkv.research.mqar import CONFIG_FILE, load_checkpoint, train

        if not (Path(self.checkpoint) / CONFIG_FILE).is_file():
            train(self.training_config(), self.checkpoint)
        return load_checkpoint(self.checkpoint), None

    def prepare(self, tokenizer) -> None:
        return None

    def run(self, model, tokenizer, data: None, context: int, seed: int, cache_options: dict):
        """The cell's metrics (``evaluate``'s) and the K/V bytes per example."""
        from jaxkv.research.mqar import evaluate

        metrics = evaluate(model, self.examples, seed, cache_options, batch_size=self.batch_size)
        return metrics, metrics["kv_bytes_per_example"]


# ---------------------------------------------------------------------------------------------
# Haystacks


@dataclasses.dataclass(frozen=True)
class Haystack:
    """The corpus as sentences, with each sentence's tokens (preceded by a space, as it is read
    inside a haystack) under one tokenizer."""

    sentences: tuple[str, ...]
    lengths: np.ndarray  # [N] int

    @classmethod
    def build(cls, tokenizer) -> Haystack:
        sentences = tuple(s for s in re.split(r"(?<=[.!?])\s+", corpus_text().replace("\n", " ")) if s)
        lengths = np.array([len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in sentences])
        return cls(sentences, lengths)

    def fill(self, start: int, num_tokens: int, needles: Sequence[tuple[float, str]]) -> Filled:
        """Consecutive sentences from ``start`` (wrapping around the corpus) holding at most
        ``num_tokens`` tokens, with each needle ``(depth, sentence)`` inserted at the sentence
        boundary nearest ``depth`` times the haystack's tokens (needles at one boundary keep their
        order). The needles' own tokens are not counted in ``num_tokens``."""
        order = (start + np.arange(len(self.sentences))) % len(self.sentences)
        ends = np.cumsum(self.lengths[order])
        count = int(np.searchsorted(ends, num_tokens, side="right"))
        if count == 0:
            raise ValueError(f"a haystack of {num_tokens} tokens cannot hold one sentence; give a longer context")
        chosen = [self.sentences[i] for i in order[:count]]
        boundaries = np.concatenate([[0], ends[:count]])  # tokens before each insertion point
        total = int(boundaries[-1])
        slots = [int(np.argmin(np.abs(boundaries - depth * total))) for depth, _ in needles]
        pieces: list[str] = []
        for index in range(count + 1):
            pieces += [needle for (_, needle), slot in zip(needles, slots) if slot == index]
            if index < count:
                pieces.append(chosen[index])
        return Filled(" ".join(pieces), tuple(float(boundaries[slot] / total) for slot in slots))


# Tokens per update of a context's prefill: one update of 16k tokens attends the whole context at
# once and does not fit this 24 GiB machine (Gemma 3 270M, float32); 4096-token updates do.
PREFILL_CHUNK = 4096


@dataclasses.dataclass
class ContextPrefills:
    """The context prefills of a retrieval task's cells on one model: each batch of contexts is
    prefilled once, into an ``Observer`` cache (every token held, with what each eviction policy
    ranks by), and every cell's cache is refilled from it (``jaxkv.research.observer``): the plain cache,
    each quantized format and each policy at each budget. An evicting cache so refilled is the
    one a prefill at its budget gives (the context is one update); a quantized one stores the
    prefill's K/V as its own update would, the context's own attention having read them in full
    precision (kvpress's protocol: the press compresses after the context's forward pass). Every
    context's prefill is kept while the model is loaded, so the runner can order cells by cache
    shape (one compile per shape, whatever the context) rather than by context; a policy with
    another SnapKV window prefills again."""

    caches: dict = dataclasses.field(default_factory=dict)  # (context, seed, first example) -> {Observer: Cache}

    def cache(self, model, contexts: list[list[int]], context: int, key: tuple, cache_options: dict):
        """The cache of ``contexts`` (one row each, ``context`` slots) under ``cache_options``."""
        from jaxkv.decoding.generate import prefill_prefix

        observed = self.caches.setdefault((context, *key), {})
        observer = observer_for(cache_options.get("eviction"), observed)
        if observer not in observed:
            observed[observer] = prefill_prefix(
                model, contexts, max_length=context, chunk=PREFILL_CHUNK, layer_builder=observer
            )
        return _compiled_refill(observed[observer], model.init_cache(len(contexts), context, **cache_options))


def observer_for(eviction: EvictionSpec | None, observed: dict) -> Observer:
    """The observer that serves ``eviction``: one of its SnapKV window for a window-scored policy,
    else any already ``observed`` (any window serves the other caches), else the default one."""
    if eviction is not None and eviction.observation_window is not None:
        return Observer(eviction.observation_window)
    return next(iter(observed), Observer())


# One compile per target cache shape: refilling eagerly would compile each of its ops apart.
_compiled_refill = jax.jit(refill)


@dataclasses.dataclass(frozen=True)
class RetrievalData:
    """What a retrieval task prepares once per model: the haystack and the shared prefills."""

    haystack: Haystack
    prefills: ContextPrefills


@dataclasses.dataclass(frozen=True)
class Filled:
    """A haystack's text and the depth (fraction of its tokens before it) each needle landed at."""

    text: str
    depths: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class RetrievalExample:
    """One prompt in two parts and its answer: ``context`` (instruction and haystack, with the chat
    template's opening) is prefilled first, ``question`` (question, the template's close and the
    start of the answer) follows through the cache; ``depth`` is the asked needle's requested depth,
    ``placed_depth`` where it landed."""

    context: list[int]
    question: list[int]
    answer: str
    depth: float
    placed_depth: float


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How a retrieval prompt reads: the instruction before the haystack, the question after it and
    the answer's first words, which the model continues. The needles and the answer's start end in
    a colon ("The pass key is: 12345"): without it Gemma 3 270M (a base model) continues "The pass
    key is" with a definition ("a secret code that ...") in 4 of 5 prompts at 1k tokens."""

    instruction: str
    question: str
    answer_prefix: str


def split_prompt(tokenizer, chat: bool, fmt: PromptFormat, haystack: str) -> tuple[list[int], list[int]]:
    """The token ids of the context (``[template opening +] instruction + haystack``) and of the
    question (``question [+ template close] + answer prefix``). In the chat template the whole
    text is one user message and the answer prefix starts the assistant's reply."""
    body = f"{fmt.instruction}\n\n{haystack}"
    tail = f"\n\n{fmt.question}"
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": body + tail}])
        cut = text.rindex(tail)
        context = tokenizer.encode(text[:cut], add_special_tokens=False)
        question = tokenizer.encode(text[cut:] + fmt.answer_prefix, add_special_tokens=False)
    else:
        context = tokenizer.encode(body)  # the tokenizer's BOS, if it adds one
        question = tokenizer.encode(f"{tail}\n{fmt.answer_prefix}", add_special_tokens=False)
    return context, question


def fit_example(
    tokenizer, chat: bool, fmt: PromptFormat, haystack: Haystack, start: int, needles, limit: int
) -> tuple[list[int], list[int], Filled]:
    """The largest haystack from sentence ``start`` whose prompt (context + question) takes at most
    ``limit`` tokens; returns its context, question and filled haystack."""
    context, question = split_prompt(tokenizer, chat, fmt, "")
    needle_tokens = sum(len(tokenizer.encode(" " + n, add_special_tokens=False)) for _, n in needles)
    room = limit - len(context) - len(question) - needle_tokens
    while room > 0:
        filled = haystack.fill(start, room, needles)
        context, question = split_prompt(tokenizer, chat, fmt, filled.text)
        excess = len(context) + len(question) - limit
        if excess <= 0:
            return context, question, filled
        room -= excess  # joining sentences tokenizes a little differently from counting them apart
    raise ValueError(f"a {limit}-token prompt leaves no room for a haystack; give a longer context")


PASSKEY = PromptFormat(
    instruction=(
        "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the pass key."
    ),
    question="What is the pass key?",
    answer_prefix="The pass key is:",
)


def passkey_examples(
    task: PasskeyTask, tokenizer, chat: bool, haystack: Haystack, context: int, seed: int
) -> list[RetrievalExample]:
    """``task.examples`` examples per depth, seeded by ``(seed, context)``; each prompt leaves
    ``task.max_new_tokens`` of the ``context`` tokens for the answer."""
    rng = np.random.default_rng((seed, context))
    examples = []
    for depth in task.depths:
        for _ in range(task.examples):
            key = str(rng.integers(10_000, 100_000))
            needle = f"The pass key is: {key}. Remember it. {key} is the pass key."
            start = int(rng.integers(len(haystack.sentences)))
            limit = context - task.max_new_tokens
            ctx, question, filled = fit_example(tokenizer, chat, PASSKEY, haystack, start, [(depth, needle)], limit)
            examples.append(RetrievalExample(ctx, question, key, depth, filled.depths[0]))
    return examples


def kv_retrieval_examples(
    task: KVRetrievalTask, tokenizer, chat: bool, haystack: Haystack, context: int, seed: int
) -> list[RetrievalExample]:
    """``task.examples`` examples per depth, seeded by ``(seed, context)``: ``task.facts`` distinct
    words with random 5-digit numbers, the asked fact at the depth, the others at uniform depths."""
    rng = np.random.default_rng((seed, context))
    examples = []
    for depth in task.depths:
        for _ in range(task.examples):
            words = [KEY_WORDS[i] for i in rng.choice(len(KEY_WORDS), task.facts, replace=False)]
            numbers = [str(n) for n in rng.integers(10_000, 100_000, task.facts)]
            depths = [depth, *rng.uniform(0, 1, task.facts - 1)]
            needles = [(d, f"The special magic number for {w} is: {n}.") for d, w, n in zip(depths, words, numbers)]
            fmt = PromptFormat(
                instruction=(
                    "Some special magic numbers are hidden inside the following text. Memorize them. "
                    "I will quiz you about one of them."
                ),
                question=f"What is the special magic number for {words[0]}?",
                answer_prefix=f"The special magic number for {words[0]} is:",
            )
            start = int(rng.integers(len(haystack.sentences)))
            limit = context - task.max_new_tokens
            ctx, question, filled = fit_example(tokenizer, chat, fmt, haystack, start, needles, limit)
            examples.append(RetrievalExample(ctx, question, numbers[0], depth, filled.depths[0]))
    return examples


def parse_number(text: str) -> str | None:
    """The first run of digits in a generated answer (None: no digits)."""
    found = re.search(r"\d+", text)
    return None if found is None else found.group()


def retrieval_metrics(
    model, tokenizer, examples: Sequence[RetrievalExample], *, context: int, max_new_tokens: int,
    batch_size: int, cache_options: dict, prefills: ContextPrefills | None = None, seed: int = 0,
) -> tuple[dict, float]:  # fmt: skip
    """Greedy answers of ``examples`` through caches built with ``cache_options`` (a capacity of
    ``context`` tokens): per batch of ``batch_size`` rows the contexts are prefilled once (by
    ``prefills``, shared by every cache of the grid; ``seed`` names the examples there) and
    refilled into the cell's cache, then the questions are decoded from it. A short last batch is
    padded with copies of its first example (every batch has one shape: one compile), whose answers
    are dropped.

    Returns the metrics (accuracy overall and per requested depth, the answers, the generated
    texts and the numbers parsed from them) and the K/V bytes the cache holds per row
    (``cache.nbytes`` / rows)."""
    from jaxkv.decoding.generate import generate

    prefills = prefills or ContextPrefills()
    texts, row_bytes = [], None
    for first in range(0, len(examples), batch_size):
        batch = list(examples[first : first + batch_size])
        rows = batch + [batch[0]] * (batch_size - len(batch))
        cache = prefills.cache(model, [e.context for e in rows], context, (seed, first), cache_options)
        out = generate(
            model, [e.question for e in rows], max_new_tokens=max_new_tokens, cache=cache,
            stop_tokens=tokenizer.eos_token_ids,
        )  # fmt: skip
        row_bytes = cache.nbytes / batch_size
        texts += [tokenizer.decode(out.row(i)) for i in range(len(batch))]
    predictions = [parse_number(text) for text in texts]
    correct = [p == e.answer for p, e in zip(predictions, examples)]
    by_depth = {}
    for depth in sorted({e.depth for e in examples}):
        hits = [c for c, e in zip(correct, examples) if e.depth == depth]
        by_depth[f"{depth:g}"] = sum(hits) / len(hits)
    metrics = {
        "accuracy": sum(correct) / len(correct),
        "accuracy_by_depth": by_depth,
        "num_examples": len(examples),
        "answers": [e.answer for e in examples],
        "predictions": predictions,
        "outputs": texts,
        "placed_depths": [round(e.placed_depth, 4) for e in examples],
    }
    return metrics, row_bytes


# ---------------------------------------------------------------------------------------------
# Perplexity


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def chunk_nll(graphdef, state, cache, tokens, targets):
    """Feed ``tokens`` ``[B, T]`` after the cache; return each row's summed NLL of ``targets``
    ``[B, T]`` (``[B]``) and the cache."""
    model = nnx.merge(graphdef, state)
    logits, cache = model(tokens, cache.next_positions(tokens.shape[1]), cache)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0], axis=-1), cache


def perplexity_through_cache(model, windows: np.ndarray, chunk: int, cache_options: dict) -> tuple[np.ndarray, int]:
    """Perplexity of each row of ``windows`` ``[B, N + 1]`` token ids (N predictions), fed in
    ``chunk``-token updates through a cache of N slots built with ``cache_options``. Returns the
    perplexities ``[B]`` and the cache's bytes."""
    length = windows.shape[1] - 1
    if length % chunk:
        raise ValueError(f"the window's {length} predictions must be a multiple of the chunk {chunk}")
    cache = model.init_cache(windows.shape[0], length, **cache_options)
    cache_bytes = cache.nbytes
    graphdef, state = nnx.split(model)
    total = np.zeros(windows.shape[0])
    for start in range(0, length, chunk):
        tokens = jnp.asarray(windows[:, start : start + chunk], jnp.int32)
        targets = jnp.asarray(windows[:, start + 1 : start + chunk + 1], jnp.int32)
        nll, cache = chunk_nll(graphdef, state, cache, tokens, targets)
        total += np.asarray(nll)
    return np.exp(total / length), cache_bytes


def perplexity_windows(ids: np.ndarray, context: int, windows: int, seed: int) -> np.ndarray:
    """``[windows, context + 1]`` consecutive windows of ``ids``, seed s taking the ``windows`` after
    seed s - 1's."""
    first = seed * windows * (context + 1)
    end = first + windows * (context + 1)
    if seed < 0 or end > len(ids):
        raise ValueError(
            f"seed {seed} needs corpus tokens {first}..{end} but the corpus has {len(ids)} for this model; "
            f"use fewer windows, shorter contexts or smaller seeds"
        )
    return ids[first:end].reshape(windows, context + 1)


def perplexity_metrics(model, ids: np.ndarray, task: PerplexityTask, context: int, seed: int, cache_options: dict):
    """Metrics of one perplexity cell (the perplexity of the pooled windows, each window's) and
    the K/V bytes per row."""
    windows = perplexity_windows(ids, context, task.windows, seed)
    per_window, cache_bytes = perplexity_through_cache(model, windows, task.chunk, cache_options)
    pooled = float(np.exp(np.mean(np.log(per_window))))  # the mean NLL over every prediction
    return {"perplexity": pooled, "per_window": per_window.tolist()}, cache_bytes / task.windows
