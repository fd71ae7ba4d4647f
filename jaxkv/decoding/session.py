"""Multi-turn chat over one cache kept across turns: each turn feeds only its new tokens."""

from __future__ import annotations

from collections.abc import Sequence


from jaxkv.decoding.driver import CacheSource, full_attention_keyword
from jaxkv.decoding.generate import Generation, generate
from jaxkv.decoding.model import DecoderModel, check_model
from jaxkv.sharding import to_host


def shared_prefix_length(cached: Sequence[int], conversation: Sequence[int]) -> int:
    """How many leading tokens ``cached`` and ``conversation`` share."""
    common = next((i for i, (a, b) in enumerate(zip(cached, conversation)) if a != b), None)
    return min(len(cached), len(conversation)) if common is None else common


class Session:
    """A conversation whose cache is kept across turns, so each turn feeds only its new tokens.

    ``reply(conversation)`` takes the whole conversation so far as token ids (e.g. the
    rendered chat template ending in the assistant's header) and generates the next answer.
    The cache holds ``self.tokens``. A turn rolls the cache back to the longest prefix they
    share with ``conversation`` (a re-tokenised history may split the generated text
    differently) and feeds the rest, so the model sees exactly ``conversation``, as if it
    were prefilled again from scratch. Where a layer cannot roll back that far (a sliding
    window), the cache is reset and the conversation prefilled whole.

    Host-side and stateful by design (it holds the latest cache); every cache operation it
    performs is the pure one.
    """

    def __init__(
        self,
        model: DecoderModel,
        *,
        max_length: int | None = None,
        cache=None,
        tokens: Sequence[int] = (),
        full_attention: str | None = None,
        cache_kind: str | None = None,
        **cache_settings,
    ):
        """A new conversation in a cache of ``max_length`` tokens (``full_attention`` and
        ``cache_settings`` go to ``model.init_cache``), or one resumed from a one-row ``cache``
        holding ``tokens`` (e.g. a system prompt loaded with ``jaxkv.persist.load_cache``).
        ``cache_kind``: the deprecated name of ``full_attention``."""
        check_model(model, DecoderModel)
        storage = full_attention_keyword(full_attention, cache_kind, stacklevel=3)
        if cache is None:
            cache = CacheSource(None, storage, max_length, cache_settings).fresh(model, 1)
        elif cache.batch_size != 1 or int(cache.lengths[0]) != len(tokens):
            raise ValueError(
                f"a resumed session needs a one-row cache holding exactly `tokens`; got {cache.batch_size} rows "
                f"holding {to_host(cache.lengths).tolist()} tokens for {len(tokens)} tokens"
            )
        self.model, self.cache, self.tokens = model, cache, list(tokens)
        self.fed_tokens = 0  # tokens the last turn prefilled (the rest came from the cache)

    def reply(self, conversation: Sequence[int], *, max_new_tokens: int, **generate_options) -> Generation:
        """Generate the answer to ``conversation`` ``[T]`` (token ids); see the class docstring.
        ``generate_options``: ``generate``'s keywords other than the cache's."""
        conversation = list(conversation)
        if not conversation:
            raise ValueError("the conversation is empty: pass its token ids")
        # The last token must be fed to get logits.
        common = min(shared_prefix_length(self.tokens, conversation), len(conversation) - 1)
        cache, undo = self.cache, len(self.tokens) - common
        budget = cache.max_rollback
        if budget is None or undo <= budget:
            cache = cache.rollback(undo)
        else:
            cache, common = cache.reset(), 0
        result = generate(
            self.model, [conversation[common:]], max_new_tokens=max_new_tokens, cache=cache, **generate_options
        )
        self.cache, self.fed_tokens = result.cache, len(conversation) - common
        self.tokens = conversation + result.row(0)[:-1]
        return result
