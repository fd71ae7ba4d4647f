"""``scripts/sharding_table.py``: the bytes each device holds of a sharded cache, computed from
shapes only, agree with the division the rules promise and with a cache really allocated on a mesh
(conftest gives every test process 8 CPU devices)."""

import runpy
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxkv.cache import Cache
from jaxkv.sharding import make_mesh

SCRIPT_PATH = Path(__file__).resolve().parents[2] / "scripts" / "sharding_table.py"
SCRIPT = runpy.run_path(str(SCRIPT_PATH), run_name="table")
cache_share, pool_paging, parse_meshes = SCRIPT["cache_share"], SCRIPT["pool_paging"], SCRIPT["parse_meshes"]

WINDOW, BATCH, MAX_LENGTH = 4, 8, 32


def tiny_config(kv_heads: int) -> dict:
    """Gemma 3's layer mix (a sliding and a full layer) with ``kv_heads`` K/V heads."""
    return {
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": kv_heads, "head_dim": 4,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW,
    }  # fmt: skip


MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]


def mesh_of(data: int, model: int):
    return make_mesh({"data": data, "model": model})


def share_of(kv_heads: int, data: int, model: int, *, paged: bool = False):
    mesh = mesh_of(data, model)
    paging = pool_paging(BATCH, MAX_LENGTH, WINDOW, mesh) if paged else None
    return cache_share(tiny_config(kv_heads), BATCH, mesh, max_length=MAX_LENGTH, dtype=jnp.float32, paging=paging)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("data,model", MESHES)
def test_eight_kv_heads_divide_over_every_device(data, model, paged):
    """8 K/V heads split over ``model`` and rows (or pages) over ``data``: each device holds an
    eighth of the K/V, whatever the mesh's shape, and nothing is replicated."""
    share = share_of(8, data, model, paged=paged)
    assert share.kv_per_device * 8 == share.kv_total > 0
    assert share.kv_heads == 8 and share.kv_heads_split == (model > 1)
    assert share.replicated == ()
    assert share.per_device * 8 >= share.total
    if paged:  # pages only: block tables and lengths are the engine's step arguments, not the cache's
        assert share.total == share.kv_total
    else:  # lengths, positions: rows only
        assert share.total > share.kv_total


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("data,model", MESHES)
def test_one_kv_head_divides_over_data_only(data, model, paged):
    """One K/V head cannot split over ``model``: it is replicated there (``replicated`` says so,
    as the table does), and only ``data`` divides the K/V."""
    share = share_of(1, data, model, paged=paged)
    assert share.kv_per_device * data == share.kv_total > 0
    assert not share.kv_heads_split
    assert share.replicated == ((f"kv_heads (1) on model={model}",) if model > 1 else ())


def test_paged_pools_hold_the_static_capacity_in_whole_pages_per_data_device():
    """Every row's 32 tokens (8 pages of 4) and its window at any offset (2 pages), plus the
    null page, rounded up to a multiple of the 4 ``data`` devices; no sliding pool without a window."""
    paging = pool_paging(BATCH, MAX_LENGTH, WINDOW, mesh_of(4, 2), page_size=4)
    assert (paging.num_pages, paging.sliding_num_pages) == (68, 20)  # 8 * 8 + 1 -> 68, 8 * 2 + 1 -> 20
    assert pool_paging(BATCH, MAX_LENGTH, None, mesh_of(4, 2), page_size=4).sliding_num_pages is None


@pytest.mark.parametrize("kv_heads,paged", [(8, False), (1, False), (8, True)])
def test_shares_equal_a_cache_allocated_on_a_mesh(kv_heads, paged):
    """The shapes-only share is what each device of a real 2 x 4 mesh holds (``device_bytes``)."""
    mesh = mesh_of(2, 4)
    paging = pool_paging(BATCH, MAX_LENGTH, WINDOW, mesh) if paged else None
    share = share_of(kv_heads, 2, 4, paged=paged)
    cache = Cache.from_config(
        tiny_config(kv_heads), BATCH, max_length=MAX_LENGTH, stacked=True, paging=paging, mesh=mesh
    )
    held = cache.device_bytes()
    assert set(held) == set(mesh.devices.flat) and set(held.values()) == {share.per_device}
    assert sum(leaf.nbytes for leaf in jax.tree.leaves(cache)) == share.total


def test_meshes_parse_and_bad_ones_name_the_part():
    assert parse_meshes("1x8, 2x4") == [{"data": 1, "model": 8}, {"data": 2, "model": 4}]
    with pytest.raises(ValueError, match="DATAxMODEL.*got '8'"):
        parse_meshes("2x4,8")


def test_the_script_tables_the_real_models():
    """End to end on SmolLM2 and Gemma 3 (real configs): 3 and 1 K/V heads stay whole on ``model``,
    so a 2 x 4 mesh halves each cache; the table says so and how it was made."""
    command = [sys.executable, str(SCRIPT_PATH), "--batch", "8", "--max-length", "1024", "--meshes", "2x4"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600).stdout
    rows = [line for line in out.splitlines() if line.startswith(("| SmolLM2", "| Gemma"))]
    assert len(rows) == 4 and all(row.endswith("| 2.00 |") for row in rows)
    assert "| SmolLM2-135M | static | 2 x 4 | 3, replicated on model=4 |" in out
    assert "Gemma 3 270M: kv_heads (1) on model=4" in out
    assert "`python scripts/sharding_table.py --batch 8 --max-length 1024 --meshes 2x4`" in out
