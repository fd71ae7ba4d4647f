"""The model contract, written once: what the decoding strategies call on a model.

Any object with these members decodes; ``jaxkv.models``' ``Llama``, ``Gemma3``, ``Qwen3_5`` and
``Bart`` implement them. ``check_model`` is the one place a model is checked against a
contract, at the entry points (``generate``, ``beam_search``, ``generate_speculative``,
``prefill_prefix``, ``Session``, the drafters), so a model that lacks a member is refused
with its name before anything compiles.

Shapes: ``tokens`` and ``positions`` ``[B, T]`` int32, a negative position marks padding
(neither stored nor attended); logits ``[B, T, V]`` float32, or ``[B, 1, V]`` at
``logits_index`` ``[B]``, or ``[B, K, V]`` at ``logits_index`` ``[B, K]`` (the serving engine
packs many requests into one row and reads one position per request).
"""

from __future__ import annotations

import typing
from typing import Any, Protocol, runtime_checkable

import jax
from typing_extensions import get_protocol_members


@runtime_checkable
class ModelConfig(Protocol):
    """What decoding reads from ``model.config``."""

    vocab_size: int  # a draft model must share the target's vocabulary
    max_position_embeddings: int  # no sequence (cached + prompt) reaches it


@runtime_checkable
class EarlyExitConfig(ModelConfig, Protocol):
    num_hidden_layers: int  # the bound of an early exit


@runtime_checkable
class DecoderModel(Protocol):
    """A decoder: ``logits, cache = model(tokens, positions, cache)``, the cache explicit."""

    config: ModelConfig

    def init_cache(self, batch_size: int, max_length: int | None = None, **cache_kwargs: Any) -> Any:
        """An empty cache of ``batch_size`` rows; ``cache_kwargs`` include ``full_attention``."""
        ...

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, cache: Any, logits_index: jax.Array | None = None
    ) -> tuple[jax.Array, Any]:
        """Logits for ``tokens`` fed after what ``cache`` holds, and the cache holding them too. A
        model the serving engine runs also takes ``packed=`` (a ``jaxkv.batch.PackedBatch``) and
        hands it to ``cached_attention`` / ``Cache.update_state``."""
        ...


@runtime_checkable
class EncoderDecoderModel(DecoderModel, Protocol):
    """A decoder whose cross-attention reads an encoded input, stored in the cache once."""

    def encode(self, tokens: jax.Array, positions: jax.Array, cache: Any) -> Any:
        """The cache with the encoder output of ``tokens`` ``[B, S]`` stored (its cross half)."""
        ...


@runtime_checkable
class EarlyExitModel(DecoderModel, Protocol):
    """A decoder that can stop after its first layers: the draft of ``SelfSpeculation``."""

    config: EarlyExitConfig

    def early_exit(self, tokens: jax.Array, positions: jax.Array, cache: Any, num_layers: int) -> tuple[jax.Array, Any]:
        """Logits from the first ``num_layers`` layers plus the final norm and head; later
        layers' cache entries are left as they were."""
        ...


def check_model(model: object, contract: type, fix: str = "see jaxkv.decoding.model for the contract") -> None:
    """Raise ``TypeError`` naming every member of ``contract`` (and of its config contract)
    that ``model`` lacks, and ``fix``."""
    missing = sorted(get_protocol_members(contract) - set(dir(model)))
    if "config" not in missing:
        config_contract = typing.get_type_hints(contract)["config"]
        missing += [f"config.{name}" for name in sorted(get_protocol_members(config_contract) - set(dir(model.config)))]
    if missing:
        raise TypeError(
            f"{type(model).__name__} does not implement {contract.__name__}: missing {', '.join(missing)}; {fix}"
        )
