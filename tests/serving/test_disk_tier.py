"""The prefix cache's disk tier (DiskPageStore): pages round-trip in every pool dtype and survive a
restart; the keys (model, page format, salted hash chain) keep pages apart; truncated, corrupt,
foreign-model, foreign-format and misnamed files are refused and removed; the size limit evicts the
least recently used; a reader never sees a half-written file; bad arguments name themselves. Then the
same store in the host tier's terms (disk_link.DiskTier: HostPages per pool).

No compiled JAX but in the last test (a tiny Llama served by two engines): the store is files and numpy.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from jaxkv.models.llama import Llama, LlamaConfig

from jaxkv.persist import model_identity
from jaxkv.quantization import QuantSpec
from jaxkv.serving import Engine, EngineConfig, disk_tier
from jaxkv.serving.disk_link import DiskTier, pool_formats
from jaxkv.serving.disk_tier import STALE_TEMP_SECONDS, SUFFIX, DiskPageStore
from jaxkv.serving.host_tier import HostPage
from jaxkv.serving.kv_manager import prefix_key
from jaxkv.serving.pages import page_hashes, salt_key
from jaxkv.serving.sizing import pool_sizes
from tests.cases import TINY_LLAMA, VOCAB

IDENTITY = {"class": "LlamaForCausalLM", "config": {"num_layers": 2}, "weights": "0f" * 32}
PAGE_FORMAT = {"pool": "full", "dtype": "float32", "quantization": None, "page_size": 4, "layout": "[L, P, H, D]"}
HASHES = page_hashes(range(32), page_size=4)  # 8 chained page hashes


def page(seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """One page's K and V: [layers 2, page_size 4, heads 3, dims 8]."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((2, 4, 3, 8)).astype(dtype) for name in ("keys", "values")}


def open_store(directory, **overrides) -> DiskPageStore:
    arguments = {"identity": IDENTITY, "page_format": PAGE_FORMAT, "max_bytes": 1 << 20} | overrides
    return DiskPageStore(directory, **arguments)


def assert_same_arrays(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    """Equal names, dtypes, shapes and bits (NaN-safe, any dtype)."""
    assert got.keys() == expected.keys()
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert got[name].tobytes() == np.ascontiguousarray(array).tobytes(), name


def page_file(store: DiskPageStore, page_hash: bytes):
    return store.directory / f"{page_hash.hex()}{SUFFIX}"


def file_size(directory) -> int:
    """File bytes of one ``page(...)`` (every such page has the same header length)."""
    probe = open_store(directory)
    probe.put(HASHES[0], page(0))
    return probe.nbytes


# --- round trips ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, np.int8])
def test_a_page_round_trips_bit_for_bit_in_every_pool_dtype(tmp_path, dtype):
    store = open_store(tmp_path)
    arrays = page(1, dtype)
    assert store.put(HASHES[0], arrays) is True
    assert store.contains(HASHES[0]) and len(store) == 1
    assert_same_arrays(store.get(HASHES[0]), arrays)


def test_a_quantized_page_with_scales_and_a_strided_array_round_trip(tmp_path):
    """As a quantized pool holds them: uint8 codes (packed int4 here: D/2 bytes) and float16 scales."""
    store = open_store(tmp_path)
    rng = np.random.default_rng(2)
    arrays = {
        "keys.codes": rng.integers(0, 256, (2, 4, 3, 4), dtype=np.uint8),
        "keys.scales": rng.random((2, 4, 3, 1)).astype(np.float16),
        "values.codes": rng.integers(0, 256, (2, 4, 3, 4), dtype=np.uint8).transpose(0, 3, 2, 1),  # not contiguous
        "values.scales": rng.random((2, 4, 3, 1)).astype(np.float16),
    }
    store.put(HASHES[0], arrays)
    assert_same_arrays(store.get(HASHES[0]), arrays)


def test_a_restarted_store_finds_the_pages_a_previous_one_wrote(tmp_path):
    first = open_store(tmp_path)
    for i, page_hash in enumerate(HASHES[:3]):
        first.put(page_hash, page(i))
    restarted = open_store(tmp_path)
    assert len(restarted) == 3 and restarted.nbytes == first.nbytes
    for i, page_hash in enumerate(HASHES[:3]):
        assert_same_arrays(restarted.get(page_hash), page(i))
    assert restarted.stats()["pages_read"] == 3


def test_putting_a_stored_page_again_writes_nothing_and_renews_its_access(tmp_path):
    store = open_store(tmp_path)
    store.put(HASHES[0], page(0))
    path = page_file(store, HASHES[0])
    os.utime(path, ns=(1, 1))
    assert store.put(HASHES[0], page(0)) is False
    assert path.stat().st_mtime_ns > 1
    assert store.stats()["pages_written"] == 1


def test_a_miss_returns_none_and_counts(tmp_path):
    store = open_store(tmp_path)
    assert store.get(HASHES[0]) is None and not store.contains(HASHES[0])
    assert store.stats() == {
        "pages_written": 0, "bytes_written": 0, "pages_read": 0, "bytes_read": 0, "misses": 1,
        "pages_evicted": 0, "bytes_evicted": 0, "rejected": dict.fromkeys(disk_tier.REJECTIONS, 0),
    }  # fmt: skip


def test_the_file_is_safetensors_keyed_by_namespace_and_page_hash(tmp_path):
    store = open_store(tmp_path / "kv")
    store.put(HASHES[1], page(1, jnp.bfloat16))
    model_digest, format_digest = store.directory.name.split("-")
    assert store.directory.parent == tmp_path / "kv" and len(model_digest) == len(format_digest) == 16
    assert [p.name for p in store.directory.iterdir()] == [f"{HASHES[1].hex()}.kvpage"]  # no temp file left
    with safetensors.safe_open(page_file(store, HASHES[1]), framework="np") as file:
        metadata = file.metadata()
        assert file.get_tensor("keys").dtype == np.uint16  # bfloat16's bits
    assert metadata["jaxkv.format"] == "jaxkv.kvpage/1" and metadata["jaxkv.page_hash"] == HASHES[1].hex()
    assert json.loads(metadata["jaxkv.identity"]) == IDENTITY
    assert json.loads(metadata["jaxkv.page_format"]) == PAGE_FORMAT
    assert json.loads(metadata["jaxkv.dtypes"]) == {"keys": "bfloat16", "values": "bfloat16"}
    assert store.stats()["bytes_written"] == store.nbytes == page_file(store, HASHES[1]).stat().st_size


def test_a_salted_chain_keys_other_files_than_the_unsalted_one(tmp_path):
    store = open_store(tmp_path)
    tokens = list(range(8))
    salted = page_hashes(tokens, 4, extra=salt_key("tenant-a"))
    store.put(salted[0], page(0))
    assert store.get(page_hashes(tokens, 4)[0]) is None
    assert store.get(page_hashes(tokens, 4, extra=salt_key("tenant-b"))[0]) is None
    assert_same_arrays(store.get(salted[0]), page(0))


# --- refused files --------------------------------------------------------------------------------------


def assert_refused(store: DiskPageStore, page_hash: bytes, reason: str) -> None:
    """``get`` returns None, removes the file and counts ``reason`` only."""
    assert store.get(page_hash) is None
    assert not page_file(store, page_hash).exists()
    rejected = store.stats()["rejected"]
    assert rejected == dict.fromkeys(disk_tier.REJECTIONS, 0) | {reason: 1}


@pytest.mark.parametrize("keep", ["nothing", "5 bytes", "half the header", "half the data", "all but one byte"])
def test_a_truncated_file_is_refused_and_removed(tmp_path, keep):
    store = open_store(tmp_path)
    store.put(HASHES[0], page(0))
    path = page_file(store, HASHES[0])
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    cut = {"nothing": 0, "5 bytes": 5, "half the header": header // 2, "half the data": (header + len(data)) // 2,
           "all but one byte": len(data) - 1}[keep]  # fmt: skip
    path.write_bytes(data[:cut])
    assert_refused(store, HASHES[0], "unreadable")


def test_a_flipped_bit_in_the_data_fails_the_checksum(tmp_path):
    store = open_store(tmp_path)
    store.put(HASHES[0], page(0))
    path = page_file(store, HASHES[0])
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x04
    path.write_bytes(bytes(data))
    assert_refused(store, HASHES[0], "checksum")


def test_a_header_edited_to_claim_another_format_fails_the_checksum(tmp_path):
    store = open_store(tmp_path)
    store.put(HASHES[0], page(0))
    path = page_file(store, HASHES[0])
    data = path.read_bytes()
    edited = data.replace(b"float32", b"float16")  # same length: the header still parses
    assert edited != data
    path.write_bytes(edited)
    assert_refused(store, HASHES[0], "checksum")


@pytest.mark.parametrize("content", ["text", "a safetensors file of something else"])
def test_a_file_that_is_not_a_page_is_refused(tmp_path, content):
    store = open_store(tmp_path)
    path = page_file(store, HASHES[0])
    if content == "text":
        path.write_text("not a page\n")
    else:
        safetensors.numpy.save_file({"keys": np.zeros(3, np.float32)}, str(path), metadata={"format": "np"})
    assert store.contains(HASHES[0])
    assert_refused(store, HASHES[0], "unreadable")


@pytest.mark.parametrize(
    ("other", "reason"),
    [({"identity": IDENTITY | {"weights": "1e" * 32}}, "foreign_model"),
     ({"page_format": PAGE_FORMAT | {"dtype": "bfloat16"}}, "foreign_format")],
)  # fmt: skip
def test_another_model_or_format_has_its_own_namespace_and_refuses_the_others_files(tmp_path, other, reason):
    mine, theirs = open_store(tmp_path), open_store(tmp_path, **other)
    assert mine.directory != theirs.directory
    theirs.put(HASHES[0], page(0))
    assert not mine.contains(HASHES[0]) and mine.get(HASHES[0]) is None
    shutil.copy(page_file(theirs, HASHES[0]), page_file(mine, HASHES[0]))  # misplaced by hand
    assert_refused(mine, HASHES[0], reason)
    assert_same_arrays(theirs.get(HASHES[0]), page(0))  # their own file is untouched


def test_a_file_under_another_pages_name_is_refused(tmp_path):
    store = open_store(tmp_path)
    store.put(HASHES[0], page(0))
    page_file(store, HASHES[0]).rename(page_file(store, HASHES[1]))
    assert_refused(store, HASHES[1], "wrong_key")


# --- size limit -----------------------------------------------------------------------------------------


def test_the_size_limit_evicts_the_least_recently_used_first(tmp_path):
    size = file_size(tmp_path / "probe")
    store = open_store(tmp_path / "kv", max_bytes=int(3.5 * size))
    for i in range(3):
        store.put(HASHES[i], page(i))
    store.get(HASHES[0])  # now page 1 is the least recently used
    store.put(HASHES[3], page(3))
    assert [store.contains(h) for h in HASHES[:4]] == [True, False, True, True]
    store.put(HASHES[4], page(4))  # then page 2
    assert [store.contains(h) for h in HASHES[:5]] == [True, False, False, True, True]
    stats = store.stats()
    assert (stats["pages_evicted"], stats["bytes_evicted"]) == (2, 2 * size)
    assert store.nbytes == 3 * size <= store.max_bytes


def test_eviction_counts_and_evicts_files_another_engine_wrote(tmp_path):
    size = file_size(tmp_path / "probe")
    first = open_store(tmp_path / "kv", max_bytes=int(3.5 * size))
    first.put(HASHES[0], page(0))
    first.put(HASHES[1], page(1))
    second = open_store(tmp_path / "kv", max_bytes=int(3.5 * size))  # another engine on the same directory
    second.put(HASHES[2], page(2))
    second.put(HASHES[3], page(3))
    assert [second.contains(h) for h in HASHES[:4]] == [False, True, True, True]
    assert second.stats()["pages_evicted"] == 1 and first.get(HASHES[0]) is None


def test_a_page_larger_than_the_limit_is_an_error(tmp_path):
    store = open_store(tmp_path, max_bytes=1000)
    with pytest.raises(ValueError, match="max_bytes=1000"):
        store.put(HASHES[0], page(0))
    assert len(store) == 0


# --- writes and crashes ---------------------------------------------------------------------------------


def test_stale_temp_files_are_removed_and_fresh_ones_left_to_their_writer(tmp_path):
    directory = open_store(tmp_path).directory
    stale, fresh = directory / ".dead.tmp", directory / ".writing.tmp"
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"x" * 100)
    old = time.time() - 2 * STALE_TEMP_SECONDS
    os.utime(stale, (old, old))
    store = open_store(tmp_path)
    assert not stale.exists() and fresh.exists()
    assert len(store) == 0 and store.nbytes == 0


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    store = open_store(tmp_path)

    def fail(source, destination):
        raise OSError("disk full")

    monkeypatch.setattr(disk_tier.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        store.put(HASHES[0], page(0))
    assert list(store.directory.iterdir()) == []


# Engine A: another process writing 24 pages of 1 MiB (``WRITTEN``) to a store on the directory in argv[1].
WRITER = f"""
import sys
import numpy as np
from jaxkv.serving.disk_tier import DiskPageStore
from jaxkv.serving.pages import page_hashes
store = DiskPageStore(sys.argv[1], identity={IDENTITY!r}, page_format={PAGE_FORMAT!r}, max_bytes=1 << 30)
for i, page_hash in enumerate(page_hashes(range(4 * 24), page_size=4)):
    store.put(page_hash, {{"keys": np.full(1 << 18, i, np.float32)}})
"""
WRITTEN = [(h, {"keys": np.full(1 << 18, i, np.float32)}) for i, h in enumerate(page_hashes(range(4 * 24), 4))]


def test_a_reader_never_sees_a_half_written_page(tmp_path):
    """Engine B reads the pages engine A (another process) is writing, each 1 MiB, so a write takes
    many page-cache copies: every read finds nothing or the whole page, never a file it refuses."""
    reader = open_store(tmp_path, max_bytes=1 << 30)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stderr=subprocess.PIPE, text=True)
    found = 0
    while found < len(WRITTEN):
        writer_done = writer.poll() is not None
        got = reader.get(WRITTEN[found][0])
        if got is None:
            assert not writer_done, (
                f"the writer ended (rc {writer.returncode}) without page {found}: {writer.stderr.read()}"
            )
            time.sleep(0.01 if found == 0 else 0)  # the writer imports for a second or two, then writes
            continue
        assert_same_arrays(got, WRITTEN[found][1])
        found += 1
    assert writer.wait() == 0
    assert reader.stats()["rejected"] == dict.fromkeys(disk_tier.REJECTIONS, 0)


# --- arguments ------------------------------------------------------------------------------------------


def test_missing_parents_are_created(tmp_path):
    store = open_store(tmp_path / "a" / "b" / "c")
    assert store.directory.parent == tmp_path / "a" / "b" / "c" and store.directory.is_dir()


@pytest.mark.parametrize("where", ["a file", "under a file", "empty", "not a path"])
def test_a_directory_that_cannot_hold_pages_is_an_error_naming_it(tmp_path, where):
    (tmp_path / "file").write_text("x")
    paths = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "kv", "empty": "", "not a path": 3}
    with pytest.raises(ValueError, match="directory"):
        open_store(paths[where])


def test_an_unwritable_directory_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier.os, "access", lambda path, mode: False)  # root writes anywhere: ask the check
    with pytest.raises(ValueError, match="directory .* is not writable"):
        open_store(tmp_path)


@pytest.mark.parametrize(
    ("argument", "value"),
    [("max_bytes", 0), ("max_bytes", -1), ("max_bytes", True), ("max_bytes", 1.5), ("max_bytes", None),
     ("identity", {}), ("identity", "llama"), ("identity", {"weights": object()}), ("page_format", {}),
     ("page_format", ["float32"])],
)  # fmt: skip
def test_bad_store_arguments_are_errors_naming_them(tmp_path, argument, value):
    with pytest.raises(ValueError, match=argument):
        open_store(tmp_path, **{argument: value})


@pytest.mark.parametrize("page_hash", [b"", bytes(65), HASHES[0].hex(), None])
def test_a_bad_page_hash_is_an_error_naming_it(tmp_path, page_hash):
    store = open_store(tmp_path)
    for call in (
        lambda: store.put(page_hash, page(0)),
        lambda: store.get(page_hash),
        lambda: store.contains(page_hash),
    ):
        with pytest.raises(ValueError, match="page_hash"):
            call()


@pytest.mark.parametrize(
    "arrays",
    [{}, [np.zeros(3)], {"keys": [1.0, 2.0]}, {1: np.zeros(3)}, {"": np.zeros(3)}, {"keys": np.zeros(3, ">f4")}],
)
def test_bad_arrays_are_errors_naming_them(tmp_path, arrays):
    store = open_store(tmp_path)
    with pytest.raises((TypeError, ValueError), match="arrays"):
        store.put(HASHES[0], arrays)
    assert len(store) == 0


# --- the host tier's view (disk_link) -------------------------------------------------------------------

# step.page_formats of a cache with a full pool (float32 K and V) and a sliding pool (int8 codes and scales).
PAGE_FORMATS = [
    ("full", [jax.ShapeDtypeStruct((2, 4, 3, 8), np.float32)] * 2),
    ("sliding", [jax.ShapeDtypeStruct((1, 4, 3, 8), np.uint8), jax.ShapeDtypeStruct((1, 4, 3, 1), np.float16)] * 2),
]


def host_page(pool: str, seed: int) -> HostPage:
    rng = np.random.default_rng(seed)
    leaves = dict(PAGE_FORMATS)[pool]
    arrays = [(rng.standard_normal(leaf.shape) * 100).astype(leaf.dtype) for leaf in leaves]
    return HostPage(sum(array.nbytes for array in arrays), arrays)


INT8 = QuantSpec(nbits=8, residual_length=0)


def open_disk_tier(directory, quantization: QuantSpec = INT8) -> DiskTier:
    formats = pool_formats(PAGE_FORMATS, page_size=4, quantization=quantization)
    return DiskTier(directory, identity=IDENTITY, formats=formats, max_bytes=1 << 20)


def test_pool_formats_list_each_pools_leaves_in_host_page_order():
    formats = pool_formats(PAGE_FORMATS, page_size=4, quantization=None)
    assert formats["full"]["leaves"] == [[[2, 4, 3, 8], "float32"]] * 2
    assert formats["sliding"]["leaves"] == [[[1, 4, 3, 8], "uint8"], [[1, 4, 3, 1], "float16"]] * 2
    assert formats["full"]["page_size"] == 4 and formats["full"]["quantization"] is None


def test_host_pages_of_each_pool_round_trip_through_the_disk_tier(tmp_path):
    disk = open_disk_tier(tmp_path)
    for pool in ("full", "sliding"):
        page = host_page(pool, 1)
        assert disk.save((pool, HASHES[0]), page) and disk.holds((pool, HASHES[0]))
        loaded = open_disk_tier(tmp_path).load((pool, HASHES[0]))  # a restarted engine
        assert loaded.nbytes == page.nbytes
        for got, expected in zip(loaded.arrays, page.arrays, strict=True):
            assert got.dtype == expected.dtype and np.array_equal(got, expected)
    assert disk.load(("full", HASHES[1])) is None
    assert {pool: stats["pages"] for pool, stats in disk.stats().items()} == {"full": 1, "sliding": 1}


def test_another_quantization_does_not_read_the_pages(tmp_path):
    open_disk_tier(tmp_path).save(("sliding", HASHES[0]), host_page("sliding", 1))
    fp8 = open_disk_tier(tmp_path, QuantSpec(format="e4m3", residual_length=0))  # uint8 codes of the same shape
    assert fp8.load(("sliding", HASHES[0])) is None


def test_the_disk_tier_refuses_pages_that_do_not_fit_its_pools(tmp_path):
    disk = open_disk_tier(tmp_path)
    with pytest.raises(ValueError, match="no arrays yet"):
        disk.save(("full", HASHES[0]), HostPage(100))
    with pytest.raises(ValueError, match="the full pool's pages"):
        disk.save(("full", HASHES[0]), host_page("sliding", 1))
    with pytest.raises(ValueError, match="no pool 'other'"):
        disk.load(("other", HASHES[0]))


def test_a_restarted_engine_serves_a_prompt_from_pages_another_engine_left_on_disk(tmp_path):
    """End to end with the host tier (the engine does not call the disk tier itself yet): engine A's
    conversation pages, evicted by other traffic into its host tier, are saved to disk; a fresh engine
    B on the same model puts them in its host tier from disk only, and the same prompt reports 24
    cached tokens and gives the tokens engine A computed."""
    model = Llama(LlamaConfig(**TINY_LLAMA | {"max_position_embeddings": 128}))
    config = {"page_size": 4, "max_num_seqs": 2, "max_num_batched_tokens": 16, "host_kv_memory": "4MiB"}
    page_bytes = pool_sizes(model, EngineConfig(**config), 128).full_page_bytes
    options = {"max_tokens": 8, "ignore_eos": True}
    rng = np.random.default_rng(3)
    shared = rng.integers(0, VOCAB, 24).tolist()  # six full pages
    turn = shared + [5, 6, 7]

    first = Engine(model, kv_memory=16 * page_bytes, preemption="recompute", **config)  # 15 usable pages
    computed = first.generate_many([turn], **options)[0]
    for _ in range(3):  # 12 pages each: the device pool forgets the conversation
        first.generate_many([rng.integers(0, VOCAB, 40).tolist()], **options)
    keys = [prefix_key("full", page_hash) for page_hash in page_hashes(shared, 4)]
    assert all(first.kv.tiers.host.holds(key) for key in keys)
    formats = pool_formats(first.runner.page_formats, page_size=4, quantization=None)
    disk = DiskTier(tmp_path, identity=model_identity(model), formats=formats, max_bytes=1 << 24)
    for key in keys:
        assert disk.save(key, first.kv.tiers.host.get(key))

    second = Engine(model, kv_memory=16 * page_bytes, preemption="recompute", **config)
    restarted = DiskTier(tmp_path, identity=model_identity(model), formats=formats, max_bytes=1 << 24)
    for key in keys:
        assert second.kv.tiers.host.demote(key, restarted.load(key))
    served = second.generate_many([turn], **options)[0]
    assert served.num_cached_tokens == 24 and served.token_ids == computed.token_ids
    assert restarted.stats()["full"]["pages_read"] == 6
    second.kv.check()
