"""The disk tier under the engine's prefix cache: full K/V pages kept as files, so a restarted server
starts warm (SGLang's HiCache and LMCache keep such a tier under their host memory).

    store = DiskPageStore("/var/cache/jaxkv", identity=model_identity(model),
                          page_format={"pool": "full", "dtype": "bfloat16", "page_size": 16, ...},
                          max_bytes=8 << 30)
    store.put(page_hash, {"keys": k, "values": v})   # one page's arrays, e.g. [L, page_size, H, D] each
    store.get(page_hash)                             # the same arrays, or None

**Keys.** A page is stored under its prefix hash (``pages.page_hashes``): the chain covers every token
up to the page's end and the request's ``salt_key``, so the salt is in the key and a salted page is
never found by another tenant's chain. The model and the page format namespace the directory::

    <directory>/<model digest>-<format digest>/<page hash in hex>.kvpage

the model digest over ``identity`` (``persist.model_identity``: class, config and weights
fingerprint), the format digest over ``page_format`` (dtype, quantization, page size, layout and
pool: whatever fixes what one page's bytes mean; each pool of an engine gets its own store, as a full
and a sliding pool hold different K/V under one hash). Two models or two formats never see, or
evict, each other's files. Each file's header repeats all three keys and ``get`` checks them, so a
file copied or renamed into the wrong namespace is refused as well.

**Format.** A file is safetensors (format ``jaxkv.kvpage/1``): one tensor per array, stored as the
unsigned integers of its itemsize (safetensors' numpy reader knows no bfloat16 or float8), with
string metadata ``jaxkv.format``, ``jaxkv.page_hash`` (hex), ``jaxkv.identity`` and
``jaxkv.page_format`` (canonical JSON), ``jaxkv.dtypes`` (each array's dtype name) and
``jaxkv.checksum``: SHA-256 over those five strings and every tensor's name, shape and bytes (SHA-256,
not blake2b: CPUs with SHA extensions hash it about 3x faster, 1.5 GB/s against 0.5 here, and the
checksum is most of a read's cost).

**Writes** go to a temp file in the namespace directory, then ``os.replace``: a reader (this
process, or another engine sharing the directory) opens the old file or the new one, never a
half-written one. No fsync: after a power loss a file may be short or empty, and the reader refuses
it. A crashed writer's temp file is removed by a later scan once ``STALE_TEMP_SECONDS`` old.

**Failures.** ``get`` refuses a file that does not parse as a page (truncated, empty, not
safetensors, not ``jaxkv.kvpage/1``: ``unreadable``), whose checksum fails (``checksum``), or whose
header names another model (``foreign_model``), another page format (``foreign_format``) or another
page than its file name (``wrong_key``): it removes the file, counts the reason and returns None.
Nothing of a refused file reaches the caller.

**Size.** Eviction is LRU by a recorded access time: ``put`` and every hit set the file's mtime to now
(``os.utime`` in nanoseconds; the kernel's own write stamps are too coarse to order pages written a
millisecond apart). When the bytes this store knows of pass ``max_bytes`` it scans the namespace
(which counts other engines' files too) and removes least recently used files until
``LOW_WATER * max_bytes`` remain. Engines sharing a directory each count their own writes between
scans, so together they may pass ``max_bytes`` by up to the headroom (``1 - LOW_WATER``) per engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

FORMAT = "jaxkv.kvpage/1"
SUFFIX = ".kvpage"
TEMP_SUFFIX = ".tmp"
LOW_WATER = 0.9  # an eviction leaves this fraction of max_bytes, so scans come once per 10% written
STALE_TEMP_SECONDS = 600  # a temp file this old belongs to a writer that died (a write takes milliseconds)
NAMESPACE_DIGEST_BYTES = 8
MAX_KEY_BYTES = 64  # a page hash's file name (hex) stays far below the usual 255-byte name limit
REJECTIONS = ("unreadable", "checksum", "foreign_model", "foreign_format", "wrong_key")
# The metadata the checksum covers, in order (jaxkv.checksum itself aside).
_SIGNED = ("jaxkv.format", "jaxkv.page_hash", "jaxkv.identity", "jaxkv.page_format", "jaxkv.dtypes")


@dataclasses.dataclass
class DiskTierStats:
    """This store object's counters since it was opened (other engines on the directory count their own)."""

    pages_written: int = 0
    bytes_written: int = 0  # file bytes: arrays plus header
    pages_read: int = 0  # hits
    bytes_read: int = 0
    misses: int = 0  # no file under the key
    pages_evicted: int = 0
    bytes_evicted: int = 0
    rejected: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(REJECTIONS, 0))


class _Rejected(Exception):
    """A file ``get`` refuses; ``reason`` is one of ``REJECTIONS``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class DiskPageStore:
    """Full K/V pages as files under ``directory``, keyed by prefix hash, namespaced by model and format.

    ``identity``: the model's identity (``persist.model_identity(model)``), ``page_format``: what fixes a
    page's bytes (dtype, quantization, page size, layout, pool); both non-empty JSON-able mappings.
    ``max_bytes``: the namespace's size limit in file bytes. ``directory`` and its parents are created.
    """

    def __init__(self, directory: str | os.PathLike, *, identity: Mapping, page_format: Mapping, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int (bytes), got {max_bytes!r}")
        self.identity = _canonical_json(identity, "identity")
        self.page_format = _canonical_json(page_format, "page_format")
        self.max_bytes = max_bytes
        self.directory = _namespace_directory(directory, self.identity, self.page_format)
        self._lock = threading.Lock()
        self._stats = DiskTierStats()
        self._known_bytes = sum(size for _, _, size in self._scan())

    def put(self, page_hash: bytes, arrays: Mapping[str, np.ndarray]) -> bool:
        """Store one page's ``arrays`` under ``page_hash``; True if a file was written, False if the
        page was stored already (equal hash, equal K/V: its access time is renewed, its file checked
        when read). Raises ValueError for a page larger than ``max_bytes``."""
        path = self._path(page_hash)
        tensors, dtypes = _encode(arrays)
        if path.is_file():
            _touch(path)
            return False
        data = safetensors.numpy.save(tensors, metadata=self._metadata(page_hash, dtypes, tensors))
        if len(data) > self.max_bytes:
            raise ValueError(f"a page of {len(data)} file bytes does not fit max_bytes={self.max_bytes}")
        self._write(path, data)
        with self._lock:
            self._stats.pages_written += 1
            self._stats.bytes_written += len(data)
            self._known_bytes += len(data)
            over = self._known_bytes > self.max_bytes
        if over:
            self._evict()
        return True

    def get(self, page_hash: bytes) -> dict[str, np.ndarray] | None:
        """The arrays stored under ``page_hash`` (as ``put`` got them), or None when there is no such
        file or it is refused (removed, reason counted; see the module docstring)."""
        path = self._path(page_hash)
        try:
            arrays, size = self._read(path, page_hash)
        except FileNotFoundError:
            with self._lock:
                self._stats.misses += 1
            return None
        except _Rejected as rejected:
            _remove(path)
            with self._lock:
                self._stats.rejected[rejected.reason] += 1
            return None
        _touch(path)
        with self._lock:
            self._stats.pages_read += 1
            self._stats.bytes_read += size
        return arrays

    def contains(self, page_hash: bytes) -> bool:
        """Whether a file is stored under ``page_hash`` (``get`` still checks it)."""
        return self._path(page_hash).is_file()

    def __len__(self) -> int:
        """Pages in the namespace, other engines' included (a directory scan)."""
        return len(self._scan())

    @property
    def nbytes(self) -> int:
        """File bytes in the namespace, other engines' included (a directory scan)."""
        return sum(size for _, _, size in self._scan())

    def stats(self) -> dict:
        """``DiskTierStats`` as a dict (a copy)."""
        with self._lock:
            return dataclasses.asdict(self._stats)

    def _path(self, page_hash: bytes) -> Path:
        if not isinstance(page_hash, bytes) or not 0 < len(page_hash) <= MAX_KEY_BYTES:
            raise ValueError(
                f"page_hash must be 1 to {MAX_KEY_BYTES} bytes (a pages.page_hashes entry), got {page_hash!r}"
            )
        return self.directory / f"{page_hash.hex()}{SUFFIX}"

    def _metadata(self, page_hash: bytes, dtypes: dict[str, str], tensors: dict[str, np.ndarray]) -> dict[str, str]:
        metadata = {
            "jaxkv.format": FORMAT,
            "jaxkv.page_hash": page_hash.hex(),
            "jaxkv.identity": self.identity,
            "jaxkv.page_format": self.page_format,
            "jaxkv.dtypes": json.dumps(dtypes, sort_keys=True),
        }
        return metadata | {"jaxkv.checksum": _checksum(metadata, tensors)}

    def _write(self, path: Path, data: bytes) -> None:
        """``data`` to ``path`` through a temp file and ``os.replace``, access time now."""
        handle, temp = tempfile.mkstemp(dir=self.directory, prefix=".", suffix=TEMP_SUFFIX)
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            _touch(Path(temp))
            os.replace(temp, path)
        except BaseException:
            _remove(Path(temp))
            raise

    def _read(self, path: Path, page_hash: bytes) -> tuple[dict[str, np.ndarray], int]:
        """The checked arrays of ``path`` and its size; raises ``_Rejected`` or FileNotFoundError."""
        size = path.stat().st_size  # before the read: a file evicted after it still counts as read
        try:
            with safetensors.safe_open(path, framework="np") as file:
                metadata = file.metadata() or {}
                if metadata.get("jaxkv.format") != FORMAT or not all(key in metadata for key in _SIGNED):
                    raise _Rejected("unreadable")
                tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (not iterable)
        except (safetensors.SafetensorError, KeyError) as error:  # KeyError: a dtype numpy's reader lacks
            raise _Rejected("unreadable") from error
        self._check(metadata, tensors, page_hash)
        return _decode(tensors, json.loads(metadata["jaxkv.dtypes"])), size

    def _check(self, metadata: dict[str, str], tensors: dict[str, np.ndarray], page_hash: bytes) -> None:
        """Raise ``_Rejected`` unless the file is intact and keyed as this store and ``page_hash``."""
        if metadata.get("jaxkv.checksum") != _checksum({key: metadata[key] for key in _SIGNED}, tensors):
            raise _Rejected("checksum")
        if metadata["jaxkv.identity"] != self.identity:
            raise _Rejected("foreign_model")
        if metadata["jaxkv.page_format"] != self.page_format:
            raise _Rejected("foreign_format")
        if metadata["jaxkv.page_hash"] != page_hash.hex():
            raise _Rejected("wrong_key")

    def _scan(self) -> list[tuple[int, str, int]]:
        """``(access time ns, file name, bytes)`` of each page file in the namespace; removes stale temp files."""
        entries = []
        stale_before = time.time() - STALE_TEMP_SECONDS
        with os.scandir(self.directory) as listing:
            for entry in listing:
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # removed by another engine since the listing
                    continue
                if entry.name.endswith(SUFFIX):
                    entries.append((stat.st_mtime_ns, entry.name, stat.st_size))
                elif entry.name.endswith(TEMP_SUFFIX) and stat.st_mtime < stale_before:
                    _remove(Path(entry.path))
        return entries

    def _evict(self) -> None:
        """Remove least recently used files until ``LOW_WATER * max_bytes`` remain (a scan: other
        engines' files count)."""
        entries = sorted(self._scan())
        total = sum(size for _, _, size in entries)
        pages = evicted = 0
        for _, name, size in entries:
            if total <= LOW_WATER * self.max_bytes:
                break
            total -= size
            if _remove(self.directory / name):
                pages += 1
                evicted += size
        with self._lock:
            self._stats.pages_evicted += pages
            self._stats.bytes_evicted += evicted
            self._known_bytes = total


def _canonical_json(value: Mapping, name: str) -> str:
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"{name} must be a non-empty mapping, got {value!r}")
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{name} must hold only JSON values (str, numbers, bools, None, lists, dicts): {error}"
        ) from error


def _namespace_directory(directory: str | os.PathLike, identity: str, page_format: str) -> Path:
    """``<directory>/<model digest>-<format digest>``, created with its parents."""
    if not isinstance(directory, str | os.PathLike) or not str(directory):
        raise ValueError(f"directory must be a non-empty path, got {directory!r}")
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise ValueError(f"directory {root} exists and is not a directory")
    digests = (
        hashlib.blake2b(text.encode(), digest_size=NAMESPACE_DIGEST_BYTES).hexdigest()
        for text in (identity, page_format)
    )
    path = root / "-".join(digests)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"directory {root}: cannot create the page store there ({error})") from error
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"directory {root}: {path} is not writable")
    return path


def _encode(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Each array as the unsigned integers of its itemsize (contiguous), and each one's dtype name."""
    if not isinstance(arrays, Mapping) or not arrays:
        raise ValueError(f"arrays must be a non-empty mapping of names to numpy arrays, got {arrays!r}")
    tensors, dtypes = {}, {}
    for name, array in arrays.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"arrays: names must be non-empty strings, got {name!r}")
        if not isinstance(array, np.ndarray):
            raise TypeError(f"arrays[{name!r}] must be a numpy array, got {type(array).__name__}")
        if jnp.dtype(array.dtype.name) != array.dtype:
            raise ValueError(f"arrays[{name!r}] has dtype {array.dtype.str}: not native byte order, or unnamed")
        tensors[name] = np.ascontiguousarray(array).view(f"u{array.dtype.itemsize}")
        dtypes[name] = array.dtype.name
    return tensors, dtypes


def _decode(tensors: dict[str, np.ndarray], dtypes: dict[str, str]) -> dict[str, np.ndarray]:
    """``_encode`` undone (``jnp.dtype`` knows ml_dtypes' names: bfloat16, float8_*)."""
    return {name: tensor.view(jnp.dtype(dtypes[name])) for name, tensor in tensors.items()}


def _checksum(signed: Mapping[str, str], tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the signed metadata strings and every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for key in _SIGNED:
        digest.update(f"{key}={signed[key]}\0".encode())
    for name in sorted(tensors):
        tensor = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}\0{tensor.dtype.str}\0{tensor.shape}\0".encode())
        digest.update(tensor.data)
    return digest.hexdigest()


def _touch(path: Path) -> None:
    """Record an access now (the file's mtime, in nanoseconds); a file evicted meanwhile is left gone."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except FileNotFoundError:
        pass


def _remove(path: Path) -> bool:
    """Unlink ``path``; False if it was gone already (another engine removed it)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
