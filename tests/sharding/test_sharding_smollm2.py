"""SmolLM2 sharded over a mesh of the 8 host devices: the single-device greedy tokens. Its own
file, so that it compiles with full optimization (``OPTIMIZED_FILES`` in tests/conftest.py: real
weights, many tokens); the tiny models on every mesh shape are in test_sharding.py.
"""

import numpy as np
from jaxkv.models.load import load_pretrained

from jaxkv.decoding.generate import generate
from jaxkv.sharding import make_mesh


def test_smollm2_data_parallel_equals_one_device():
    """SmolLM2, batch 8 over 8 devices on ``data`` (its 3 K/V heads take no ``model`` axis): the
    single-device greedy tokens."""
    prompts = [[1, 504, 3458, 314, 4289, 8, 2121 + i, 30][: 3 + i] for i in range(8)]
    reference, _ = load_pretrained("smollm2")
    expected = generate(reference, prompts, max_new_tokens=12)
    model, _ = load_pretrained("smollm2", mesh=make_mesh({"data": 8, "model": 1}))
    assert model.layers["wq"][...].sharding.is_fully_replicated
    result = generate(model, prompts, max_new_tokens=12)
    np.testing.assert_array_equal(result.tokens, expected.tokens)
    held = result.cache.device_bytes()
    assert set(held.values()) == {result.cache.nbytes // 8}
