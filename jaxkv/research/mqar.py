"""Multi-query associative recall (MQAR): a small Llama trained from scratch to look values up
by key, a testbed where the right answer is known and a cache policy's errors can be traced to
the tokens it dropped.

Data layout (``mqar_batch``). The vocabulary is split in two: key tokens ``[0, num_keys)`` and
value tokens ``[num_keys, num_keys + num_values)``. One example of ``N = num_pairs`` pairs and
``Q = num_queries`` queries is ``T = 2N + Q`` tokens::

    position   0   1   2   3  ...  2N-2  2N-1 | 2N   ...  2N+Q-1
    token      k0  v0  k1  v1 ...  kN-1  vN-1 | k_p0 ...  k_pQ-1      (the context, then the queries)
    target     -   -   -   -  ...  -     -    | v_p0 ...  v_pQ-1

The N keys of a row are distinct, the values drawn with replacement; the queries are Q distinct
keys of the context in random order (``query_pairs[b, j] = p_j``, the pair queried at position
2N + j). Only query positions are scored (``mask``): at query j the model must predict v_pj, the
value that followed k_pj in the context, so pair p's key sits at position 2p and its value at 2p + 1.

Model: ``jaxkv.models.llama.Llama`` with a tiny ``LlamaConfig``, so every jaxkv cache (quantized,
evicting) applies to it unchanged. Training (``train``): AdamW with a warmup + cosine schedule on
the cross-entropy of the query positions, fresh seeded batches every step; it writes
``model.safetensors`` (the parameters as ``Llama(config, params)`` takes them), ``config.json``
(the ``MQARConfig``), ``loss.png`` and ``metrics.json`` into the output directory.

Evaluation (``evaluate``) runs like a real decode: the context is prefilled through the cache,
then the Q queries are fed as one chunk and the value predicted at each is read. One chunk,
not one query per step, because that is how a compressed-context benchmark asks its question
(kvpress: compress the context, then feed the question uncompressed): every query sees exactly
the context the prefill kept, whatever order the queries come in, so each wrong answer can be
traced to the slots held right after the prefill. Fed one by one, queries would also evict
context tokens (their own K/V take slots), and a query's answer would depend on its position
in the question.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from pydantic import PositiveFloat, PositiveInt, model_validator
from safetensors.numpy import load_file, save_file
from tqdm.auto import tqdm

from jaxkv.config import Strict
from jaxkv.cache import Cache
from jaxkv.layers.evicting import EvictingLayer
from jaxkv.models.llama import Llama, LlamaConfig, layer_shapes, param_shapes

CHECKPOINT_FILE = "model.safetensors"  # the parameters, as Llama(config, params) takes them
CONFIG_FILE = "config.json"  # the MQARConfig
LOSS_PLOT_FILE = "loss.png"
METRICS_FILE = "metrics.json"  # steps, training seconds, final loss, full-cache recall


# --- config ------------------------------------------------------------------------------
class DataConfig(Strict):
    """The task: ``num_pairs`` key-value pairs, then ``num_queries`` of their keys (see the module docstring)."""

    num_pairs: PositiveInt = 16
    num_queries: PositiveInt = 16
    num_keys: PositiveInt = 32
    num_values: PositiveInt = 32

    @model_validator(mode="after")
    def _fits(self):
        if self.num_pairs > self.num_keys:
            raise ValueError(
                f"num_pairs {self.num_pairs} needs as many distinct keys: raise num_keys ({self.num_keys})"
            )
        if self.num_queries > self.num_pairs:
            raise ValueError(
                f"num_queries {self.num_queries} asks for distinct keys of the context: at most num_pairs "
                f"({self.num_pairs})"
            )
        return self

    @property
    def context_length(self) -> int:
        return 2 * self.num_pairs

    @property
    def sequence_length(self) -> int:
        return self.context_length + self.num_queries

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values


class MQARModelConfig(Strict):
    """The decoder's size (a ``LlamaConfig``; its vocabulary and context come from the data)."""

    hidden_size: PositiveInt = 64
    intermediate_size: PositiveInt = 128
    num_layers: PositiveInt = 2
    num_heads: PositiveInt = 4
    num_kv_heads: PositiveInt = 2


class TrainConfig(Strict):
    """AdamW on a linear warmup then cosine decay to ``final_lr_fraction`` of the peak."""

    steps: PositiveInt = 600
    batch_size: PositiveInt = 32
    learning_rate: PositiveFloat = 0.005
    warmup_steps: int = 50
    final_lr_fraction: float = 0.01
    weight_decay: float = 0.1
    max_grad_norm: PositiveFloat = 1.0
    seed: int = 0
    eval_examples: PositiveInt = 1024  # recall measured with the full cache at the end
    eval_seed: int = 1234

    @model_validator(mode="after")
    def _warmup_within_steps(self):
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
        return self


class MQARConfig(Strict):
    """What ``jaxkv train-mqar`` trains (configs/mqar.yaml)."""

    data: DataConfig = DataConfig()
    model: MQARModelConfig = MQARModelConfig()
    train: TrainConfig = TrainConfig()
    output: str = "results/mqar-model"  # checkpoint directory; --output overrides it

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.data.vocab_size, hidden_size=self.model.hidden_size,
            intermediate_size=self.model.intermediate_size, num_hidden_layers=self.model.num_layers,
            num_attention_heads=self.model.num_heads, num_key_value_heads=self.model.num_kv_heads,
            max_position_embeddings=self.data.sequence_length,
        )  # fmt: skip


# --- data --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Batch:
    """A batch of MQAR examples (layout in the module docstring)."""

    tokens: np.ndarray  # [B, T] int32
    targets: np.ndarray  # [B, T] int32: the value token at query positions, -1 elsewhere
    mask: np.ndarray  # [B, T] bool: the scored (query) positions
    query_pairs: np.ndarray  # [B, Q] int32: the pair each query asks for (its key at 2p, its value at 2p + 1)


def mqar_batch(data: DataConfig, batch_size: int, rng: np.random.Generator) -> Batch:
    """``batch_size`` fresh examples drawn from ``rng``."""
    n, q = data.num_pairs, data.num_queries
    keys = np.argsort(rng.random((batch_size, data.num_keys)), axis=1)[:, :n]  # distinct keys per row
    values = data.num_keys + rng.integers(0, data.num_values, (batch_size, n))
    query_pairs = np.argsort(rng.random((batch_size, n)), axis=1)[:, :q]
    tokens = np.empty((batch_size, data.sequence_length), np.int32)
    tokens[:, 0 : 2 * n : 2], tokens[:, 1 : 2 * n : 2] = keys, values
    tokens[:, 2 * n :] = np.take_along_axis(keys, query_pairs, axis=1)
    targets = np.full_like(tokens, -1)
    targets[:, 2 * n :] = np.take_along_axis(values, query_pairs, axis=1)
    return Batch(tokens, targets, targets >= 0, query_pairs.astype(np.int32))


# --- model -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RecallModel:
    """A trained MQAR decoder and the config it was trained with (the data layout ``evaluate`` needs)."""

    decoder: Llama
    config: MQARConfig


def initial_params(config: LlamaConfig, seed: int) -> dict[str, jax.Array]:
    """Random parameters (``param_shapes`` names, ``x @ w`` layout): norms 1, the embedding N(0, 1), every
    matrix N(0, 1 / fan_in). Why not ``Llama``'s own N(0, 0.02) (a pretrained model's scale): with it the
    attention logits start near 0, every head attends uniformly and the query/key gradients are ~70x
    smaller than the value/output ones; measured on configs/mqar.yaml-like tasks, recall was still
    <= 12% after 600-800 steps, where this init jumps past 90% at about step 300."""
    shapes = param_shapes(config)
    keys = dict(zip(shapes, jax.random.split(jax.random.key(seed), len(shapes))))
    return {
        name: jnp.ones(shape)
        if "norm" in name
        else jax.random.normal(keys[name], shape) / (1.0 if name == "embed" else math.sqrt(shape[-2]))
        for name, shape in shapes.items()
    }


def build_decoder(config: MQARConfig, params: dict | None = None) -> Llama:
    """The Llama of ``config`` with ``params`` (``param_shapes`` names), or random ones (``initial_params``,
    ``config.train.seed``). Stored ``in_out`` so its parameters read back as ``params`` name them
    (``decoder_params``)."""
    llama_config = config.llama_config()
    params = initial_params(llama_config, config.train.seed) if params is None else params
    return Llama(llama_config, params, weight_layout="in_out")


def decoder_params(decoder: Llama) -> dict[str, np.ndarray]:
    """The parameters of an ``in_out`` decoder under ``param_shapes``' names (what ``Llama(config, params)`` takes)."""
    params = {"embed": decoder.embed[...], "norm": decoder.norm[...], "lm_head": decoder.lm_head[...]}
    params |= {name: decoder.layers[name][...] for name in layer_shapes(decoder.config)}
    return {name: np.asarray(value) for name, value in params.items()}


def save_checkpoint(model: RecallModel, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(decoder_params(model.decoder), directory / CHECKPOINT_FILE)
    (directory / CONFIG_FILE).write_text(model.config.model_dump_json(indent=2))


def load_checkpoint(path: str | Path) -> RecallModel:
    """The model ``train`` saved in the directory ``path``."""
    path = Path(path)
    for name in (CHECKPOINT_FILE, CONFIG_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"{path / name} does not exist: train one with `jaxkv train-mqar CONFIG --output {path}`"
            )
    config = MQARConfig.model_validate_json((path / CONFIG_FILE).read_text())
    params = {name: jnp.asarray(value) for name, value in load_file(path / CHECKPOINT_FILE).items()}
    return RecallModel(build_decoder(config, params), config)


# --- training ----------------------------------------------------------------------------
def optimizer(train: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train.learning_rate, warmup_steps=train.warmup_steps, decay_steps=train.steps,
        end_value=train.learning_rate * train.final_lr_fraction,
    )  # fmt: skip
    return optax.chain(
        optax.clip_by_global_norm(train.max_grad_norm), optax.adamw(schedule, weight_decay=train.weight_decay)
    )


def query_loss(decoder: Llama, tokens: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy and accuracy over the scored positions of ``tokens`` ``[B, T]``, run
    through a fresh static cache (the decoder reads K/V from a cache, as it does when decoding)."""
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    logits, _ = decoder(tokens, positions, decoder.init_cache(batch, length))
    safe_targets = jnp.where(mask, targets, 0)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, safe_targets)
    correct = jnp.argmax(logits, axis=-1) == safe_targets
    count = jnp.sum(mask)
    return jnp.sum(jnp.where(mask, losses, 0.0)) / count, jnp.sum(correct & mask) / count


@functools.partial(jax.jit, static_argnames=("graphdef", "tx"), donate_argnames=("params", "opt_state"))
def train_step(graphdef, tx, params, opt_state, tokens, targets, mask):
    """One AdamW step on a batch ``[B, T]``; returns the new parameters, optimizer state, loss and accuracy."""

    def loss_fn(params):
        return query_loss(nnx.merge(graphdef, params), tokens, targets, mask)

    (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, accuracy


@dataclasses.dataclass(frozen=True)
class TrainResult:
    model: RecallModel
    output: Path  # the directory holding the checkpoint, loss curve and metrics
    losses: list[float]  # per step
    accuracies: list[float]  # per step, on that step's training batch
    seconds: float
    recall: float  # full-cache recall on config.train.eval_examples fresh examples


def train(config: MQARConfig, output: str | Path | None = None, progress: bool = True) -> TrainResult:
    """Train a decoder on fresh MQAR batches (seeded by ``config.train.seed``), measure its full-cache
    recall, and save the checkpoint, loss curve and metrics into ``output`` (default ``config.output``)."""
    output = Path(config.output if output is None else output)
    train_config = config.train
    graphdef, params = nnx.split(build_decoder(config))
    tx = optimizer(train_config)
    opt_state = tx.init(params)
    rng = np.random.default_rng(train_config.seed)
    losses, accuracies = [], []
    start = time.perf_counter()
    bar = tqdm(range(train_config.steps), desc="train-mqar", disable=not progress)
    for step in bar:
        batch = mqar_batch(config.data, train_config.batch_size, rng)
        params, opt_state, loss, accuracy = train_step(
            graphdef, tx, params, opt_state, batch.tokens, batch.targets, batch.mask
        )
        losses.append(float(loss))
        accuracies.append(float(accuracy))
        if step % 25 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{accuracies[-1]:.3f}")
    seconds = time.perf_counter() - start
    model = RecallModel(nnx.merge(graphdef, params), config)
    recall = evaluate(model, train_config.eval_examples, train_config.eval_seed, {})["accuracy"]
    save_checkpoint(model, output)
    plot_training(losses, accuracies, output / LOSS_PLOT_FILE)
    metrics = {"steps": train_config.steps, "train_seconds": seconds, "final_loss": losses[-1], "recall": recall}
    (output / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    return TrainResult(model, output, losses, accuracies, seconds, recall)


def plot_training(losses: list[float], accuracies: list[float], path: Path) -> None:
    """The training loss (log scale) and the recall on each training batch, against the step."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, loss_axis = plt.subplots(figsize=(7, 4))
    loss_axis.plot(losses, color="tab:blue", linewidth=0.8)
    loss_axis.set(xlabel="step", ylabel="cross-entropy at the queries", yscale="log", title="MQAR training")
    accuracy_axis = loss_axis.twinx()
    accuracy_axis.plot(accuracies, color="tab:orange", linewidth=0.8)
    accuracy_axis.set(ylabel="recall on the training batch", ylim=(0, 1.02))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --- evaluation --------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("graphdef",))
def forward(graphdef, state, tokens: jax.Array, positions: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """Logits ``[B, T, V]`` of ``tokens`` ``[B, T]`` at ``positions``, and the updated cache."""
    return nnx.merge(graphdef, state)(tokens, positions, cache)


def held_positions(cache: Cache, context_length: int) -> np.ndarray | None:
    """``[B, L, C]`` bool: does some K/V head of layer l still hold context position c? None when no layer
    of the cache evicts (every token is held). Read from each evicting layer's ``slot_positions``
    ``[B, H_kv, N]`` (-1: an empty or evicted slot)."""
    layers = [cache.layer(i) for i in range(len(cache.layer_types))]
    if not any(isinstance(layer, EvictingLayer) for layer in layers):
        return None
    held = []
    for layer in layers:
        if isinstance(layer, EvictingLayer):
            slots = np.asarray(layer.slot_positions)  # [B, H_kv, N]
            held.append((slots[..., None] == np.arange(context_length)).any(axis=(1, 2)))  # [B, C]
        else:
            held.append(np.ones((cache.batch_size, context_length), bool))
    return np.stack(held, axis=1)


def evaluate(model: RecallModel, num_examples: int, seed: int, cache_kwargs: dict, batch_size: int = 256) -> dict:
    """Recall of ``model`` on ``num_examples`` fresh examples (seeded by ``seed``), through a cache built by
    ``decoder.init_cache(B, T, **cache_kwargs)`` (e.g. ``eviction=EvictionSpec(...)``,
    ``quantization=QuantSpec(...)``; ``{}``: the full static cache). The context is prefilled, then the
    queries are fed as one chunk (see the module docstring) and the arg-max over the whole vocabulary
    at each query is the predicted value.

    Returns ``accuracy``; ``kv_bytes`` (``cache.nbytes`` of the first batch, ``min(batch_size,
    num_examples)`` rows; ``kv_bytes_per_example`` divides it by them); ``num_queries`` and
    ``num_errors``; and the errors' attribution. A query's pair is lost when its key or its value
    token was evicted, right after the prefill, from every K/V head of some layer (no head of that
    layer could read it): ``evicted_fraction`` (of all queries), ``errors_evicted`` /
    ``errors_present`` (fractions of the wrong answers whose pair was lost / fully held),
    ``errors_value_evicted`` / ``errors_key_evicted`` (by which token), and ``accuracy_present`` /
    ``accuracy_evicted`` (recall on the queries of held / lost pairs; NaN when there are none).
    Without an evicting layer every pair is held.
    """
    if num_examples < 1 or batch_size < 1:
        raise ValueError(f"evaluate needs num_examples >= 1 and batch_size >= 1, got {num_examples}, {batch_size}")
    data = model.config.data
    graphdef, state = nnx.split(model.decoder)
    rng = np.random.default_rng(seed)
    context = data.context_length
    correct, key_lost, value_lost, kv_bytes = [], [], [], None
    for start in range(0, num_examples, batch_size):
        rows = min(batch_size, num_examples - start)
        batch = mqar_batch(data, rows, rng)
        positions = np.broadcast_to(np.arange(data.sequence_length, dtype=np.int32), batch.tokens.shape)
        cache = model.decoder.init_cache(rows, data.sequence_length, **cache_kwargs)
        kv_bytes = cache.nbytes if kv_bytes is None else kv_bytes
        _, cache = forward(graphdef, state, batch.tokens[:, :context], positions[:, :context], cache)
        held = held_positions(cache, context)
        logits, _ = forward(graphdef, state, batch.tokens[:, context:], positions[:, context:], cache)
        correct.append(np.asarray(jnp.argmax(logits, axis=-1)) == batch.targets[:, context:])
        if held is None:
            key_lost.append(np.zeros_like(batch.query_pairs, bool))
            value_lost.append(np.zeros_like(batch.query_pairs, bool))
        else:
            rows_index = np.arange(rows)[:, None, None]
            layers_index = np.arange(held.shape[1])[None, :, None]
            pairs = batch.query_pairs[:, None, :]  # [B, 1, Q]
            key_lost.append(~held[rows_index, layers_index, 2 * pairs].all(axis=1))  # [B, Q]
            value_lost.append(~held[rows_index, layers_index, 2 * pairs + 1].all(axis=1))
    correct, key_lost, value_lost = (np.concatenate(parts).ravel() for parts in (correct, key_lost, value_lost))
    lost = key_lost | value_lost
    wrong = ~correct
    num_errors = int(wrong.sum())

    def fraction(numerator, denominator) -> float:
        return float(numerator.sum() / denominator.sum()) if denominator.any() else math.nan

    return {
        "accuracy": float(correct.mean()),
        "kv_bytes": int(kv_bytes),
        "kv_bytes_per_example": kv_bytes / min(batch_size, num_examples),
        "num_queries": int(correct.size),
        "num_errors": num_errors,
        "evicted_fraction": float(lost.mean()),
        "errors_evicted": fraction(wrong & lost, wrong),
        "errors_present": fraction(wrong & ~lost, wrong),
        "errors_value_evicted": fraction(wrong & value_lost, wrong),
        "errors_key_evicted": fraction(wrong & key_lost, wrong),
        "accuracy_present": fraction(correct & ~lost, ~lost),
        "accuracy_evicted": fraction(correct & lost, lost),
    }
