"""Weights backed by huge pages (``jaxkv.hugepages``): where the kernel offers transparent huge
pages, a large host array lands on them without changing a value; small arrays are left alone."""

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.hugepages import on_huge_pages
from jaxkv.models.llama import Llama, LlamaConfig

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    """The kernel gives huge pages at least where asked ("[always]" or "[madvise]", not "[never]")."""
    return THP.is_file() and "[never]" not in THP.read_text()


def advised_huge(array) -> bool:
    """The mapping holding ``array``'s buffer is advised for huge pages (``hg`` in its VmFlags): what
    jaxkv controls; whether the kernel then finds free 2 MiB pages depends on the machine's load."""
    address, current = array.unsafe_buffer_pointer(), None
    for line in Path(f"/proc/{os.getpid()}/smaps").read_text().splitlines():
        if "-" in line.split(" ")[0] and line[0] in "0123456789abcdef":
            low, high = (int(x, 16) for x in line.split(" ")[0].split("-"))
            current = low <= address < high
        elif line.startswith("VmFlags:") and current:
            return "hg" in line.split()
    return False


def test_a_large_array_lands_on_huge_pages_unchanged():
    host = np.random.default_rng(0).standard_normal((8, 1024, 1024), np.float32)  # 32 MiB
    array = on_huge_pages(host)
    np.testing.assert_array_equal(np.asarray(array), host)
    assert array.dtype == jnp.float32 and array.shape == host.shape
    if huge_pages_offered():
        assert advised_huge(array)
    device_array = jnp.asarray(host) + 1  # a jax array on the CPU device: copied over too
    np.testing.assert_array_equal(np.asarray(on_huge_pages(device_array)), host + 1)


def test_small_arrays_are_left_alone_and_model_weights_are_moved():
    small = jnp.ones(16)
    assert on_huge_pages(small) is not None and np.asarray(on_huge_pages(small)).sum() == 16
    config = LlamaConfig(
        vocab_size=32, hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
        max_position_embeddings=64,
    )  # fmt: skip
    model = Llama(config, seed=0)  # its 2 x 512 x 2048 MLP stacks are 8 MiB each
    if huge_pages_offered():
        assert advised_huge(model.layers["w_up"][...])
    reference = Llama(config, seed=0)
    tokens, positions = jnp.ones((1, 3), jnp.int32), jnp.arange(3)[None]
    logits, _ = model(tokens, positions, model.init_cache(1, 8))
    expected, _ = reference(tokens, positions, reference.init_cache(1, 8))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(expected))
    assert len(jax.tree.leaves(model.layers["w_up"][...].devices())) == 1
