"""The tiny models the engine's test files share: Llama, and Llama and Gemma 3 (a sliding window
of 8, so prompts run past it) as the module-scoped ``model`` fixture."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig

from jaxkv.batch import PagedStorage
from jaxkv.protocol import has
from jaxkv.serving.pages import NULL_PAGE
from tests.cases import TINY_GEMMA, TINY_LLAMA

LLAMA = TINY_LLAMA | {"max_position_embeddings": 256}
GEMMA = TINY_GEMMA | {"sliding_window": 8, "max_position_embeddings": 256}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return Llama(LlamaConfig(**LLAMA)) if request.param == "llama" else Gemma3(Gemma3Config(**GEMMA))


@pytest.fixture(scope="module")
def llama():
    return Llama(LlamaConfig(**LLAMA))


def poisoned(engine):
    """The engine's cache with NaN in every page at refcount 0 and in the null page, in every pool
    (0 in an int leaf: a slot position that every query would see if the mask read it)."""
    cache = engine.runner.cache
    for pool in engine.kv.pools:
        manager = pool.manager
        free = np.asarray([NULL_PAGE] + [p for p in range(1, manager.num_pages) if manager.refcount(p) == 0])
        for index, group in enumerate(cache.groups):
            if has(group, PagedStorage) and group.pool == pool.name:
                cache = cache.with_group(index, jax.tree.map(lambda leaf, free=free: _poison(leaf, free), group))
    return cache


def _poison(leaf: jax.Array, pages: np.ndarray) -> jax.Array:
    return leaf.at[:, pages].set(jnp.nan if jnp.issubdtype(leaf.dtype, jnp.floating) else 0)
