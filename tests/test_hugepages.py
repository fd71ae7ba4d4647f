"""Host arrays backed by huge pages (``jaxkv.hugepages``): where the kernel offers transparent huge
pages, a large array's whole 2 MiB pages are collapsed; elsewhere nothing happens and nothing fails."""

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxkv.hugepages import HUGE_PAGE, use_huge_pages
from jaxkv.models.llama import Llama, LlamaConfig

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    """The kernel gives huge pages at least where asked ("[always]" or "[madvise]", not "[never]")."""
    return THP.is_file() and "[never]" not in THP.read_text()


def anon_huge_bytes() -> int:
    for line in Path(f"/proc/{os.getpid()}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def test_a_large_array_is_collapsed_into_huge_pages():
    array = jnp.asarray(np.random.default_rng(0).standard_normal((4, 1024, 1024), np.float32))  # 16 MiB
    before = anon_huge_bytes()
    collapsed = use_huge_pages(array)
    if not huge_pages_offered():
        assert collapsed == 0
        return
    assert collapsed >= 16 * 2**20 - 2 * HUGE_PAGE  # every whole 2 MiB page inside the buffer
    assert anon_huge_bytes() - before >= collapsed // 2  # the kernel reports them (other buffers may split)
    np.testing.assert_array_equal(np.asarray(array)[0, 0, :4], np.asarray(array)[0, 0, :4])  # still readable


def test_small_arrays_and_model_weights():
    assert use_huge_pages(jnp.ones(16)) == 0  # no whole huge page inside
    config = LlamaConfig(
        vocab_size=32, hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
        max_position_embeddings=64,
    )  # fmt: skip
    before = anon_huge_bytes()
    model = Llama(config, seed=0)  # its 2 x 512 x 2048 MLP stacks are 8 MiB each
    if huge_pages_offered():
        assert anon_huge_bytes() - before >= 4 * HUGE_PAGE
    logits, _ = model(jnp.ones((1, 3), jnp.int32), jnp.arange(3)[None], model.init_cache(1, 8))
    assert np.isfinite(np.asarray(logits)).all()
