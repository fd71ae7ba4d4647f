"""The tiny models the engine's test files share: Llama, and Llama and Gemma 3 (a sliding window
of 8, so prompts run past it) as the module-scoped ``model`` fixture."""

import pytest
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig

from tests.cases import TINY_GEMMA, TINY_LLAMA

LLAMA = TINY_LLAMA | {"max_position_embeddings": 256}
GEMMA = TINY_GEMMA | {"sliding_window": 8, "max_position_embeddings": 256}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return Llama(LlamaConfig(**LLAMA)) if request.param == "llama" else Gemma3(Gemma3Config(**GEMMA))


@pytest.fixture(scope="module")
def llama():
    return Llama(LlamaConfig(**LLAMA))
