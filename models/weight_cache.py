"""A per-user cache of converted files, so a quantized GGUF is dequantized once, not on every load.

Where: ``$XDG_CACHE_HOME/jaxkv`` (``~/.cache/jaxkv`` when it is unset). What: safetensors
files whose metadata carries a CRC-32 of everything else in the file. A file that is
truncated, corrupt or unreadable reads as absent (with a warning) and is deleted, so the
caller converts again and rewrites it; it is never used. A cache that cannot be written
(read-only home, full disk) costs a warning, not the load.

Files are written under a temporary name and renamed into place: a killed writer leaves
nothing that looks valid, and a reader's memory map of the file it replaces stays intact
(truncating a file in place would pull the pages from under arrays that map it).

Callers key entries by the source file's SHA-256 (``file_sha256``). Hashing a few hundred MB
would be a noticeable part of a warm load, so a file's digest is remembered under
``digests/`` and computed again only when the file's path, inode, size or times change.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import warnings
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

CHECKSUM_KEY = "jaxkv.crc32"  # metadata key of the file's own checksum
_DTYPES = {"F32": np.float32, "U8": np.uint8}  # what write_checked is given (float32 weights, kept blocks)
_SHA256 = re.compile(r"[0-9a-f]{64}")


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/jaxkv``, or ``~/.cache/jaxkv`` when it is unset or relative (the XDG
    base directory spec says to ignore a relative one)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "jaxkv"


def file_sha256(path: str | Path) -> str:
    """The hex SHA-256 of ``path``'s bytes, hashed once per version of the file and remembered.

    A version is (path, inode, size, mtime, ctime): replacing the file changes the inode,
    rewriting it changes ctime even where a copy keeps the source's mtime (``cp -p``)."""
    path = Path(path).resolve()
    stat = path.stat()
    identity = {
        "path": str(path), "inode": stat.st_ino, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
    }  # fmt: skip
    record = cache_dir() / "digests" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    remembered = _read_json(record)
    digest = remembered.get("sha256")
    if all(remembered.get(key) == value for key, value in identity.items()) and _SHA256.fullmatch(str(digest)):
        return digest
    with path.open("rb") as source:
        digest = hashlib.file_digest(source, "sha256").hexdigest()
    _try_to_cache(record, lambda temporary: temporary.write_text(json.dumps(identity | {"sha256": digest})))
    return digest


def _read_json(path: Path) -> dict:
    """``path``'s JSON object, or ``{}`` if it is absent or not one (then it is rewritten)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def write_checked(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """A safetensors file of ``tensors`` (contiguous float32 arrays) and ``metadata``, plus the
    checksum ``read_checked`` verifies; written atomically. Failing to write only warns."""
    from safetensors.numpy import save_file

    checked = {**metadata, CHECKSUM_KEY: _checksum(tensors, metadata)}
    _try_to_cache(path, lambda temporary: save_file(dict(tensors), temporary, metadata=checked))


def read_checked(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]] | None:
    """``(tensors, metadata)`` of a ``write_checked`` file, the tensors read-only views of its
    memory map; None if there is none, or if it is truncated or corrupt (then it is deleted,
    with a warning)."""
    if not path.is_file():
        return None
    try:
        tensors, metadata = _map_safetensors(path)
    except (OSError, ValueError, KeyError, TypeError) as err:  # whatever a damaged header makes of the parse
        return discard(path, f"is unreadable ({type(err).__name__}: {err})")
    stored = metadata.pop(CHECKSUM_KEY, None)
    if stored != _checksum(tensors, metadata):
        return discard(path, "fails its checksum (corrupt)")
    return tensors, metadata


def _map_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The float32 tensors, as views of a memory map, and the metadata of a safetensors file
    (an 8-byte little-endian header length, a JSON header, the tensors' bytes back to back).

    safetensors' own numpy reader copies every tensor out of its map: reading the layout
    here saves that copy, a fifth of a warm load. The checksum vouches for the content."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    length = int(raw[:8].view("<u8")[0]) if raw.size >= 8 else raw.size
    if 8 + length > raw.size:
        raise ValueError(f"the header is cut off ({raw.size} bytes)")
    header = json.loads(raw[8 : 8 + length].tobytes())
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        raise ValueError("the header is not a safetensors header")
    metadata, data = header.pop("__metadata__", {}), raw[8 + length :]
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if end != data.size:
        raise ValueError(f"the tensors end at byte {end} of {data.size} (truncated or extended)")
    tensors = {
        name: data[slice(*entry["data_offsets"])].view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        for name, entry in header.items()
    }
    return tensors, metadata


def discard(path: Path, problem: str) -> None:
    """Warn that cached ``path`` ``problem`` and delete it, so it is built again."""
    warnings.warn(f"cached file {path} {problem}; converting again", stacklevel=3)
    with contextlib.suppress(OSError):  # a read-only cache: the rewrite will warn too
        path.unlink(missing_ok=True)


def _checksum(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> str:
    """CRC-32 (corruption, not tampering) of the metadata and of each tensor's name, dtype,
    shape and bytes in name order: ~0.1 s per GB."""
    crc = zlib.crc32(json.dumps(sorted(metadata.items())).encode())
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        crc = zlib.crc32(array, zlib.crc32(f"{name}:{array.dtype}:{array.shape}".encode(), crc))
    return f"{crc:08x}"


def _try_to_cache(path: Path, write: Callable[[Path], None]) -> None:
    """``write(a temporary file)`` beside ``path``, then rename it to ``path``: readers see the
    old file or the whole new one. Failing to write only warns: the cache is an optimization."""
    from safetensors import SafetensorError  # how safetensors reports a failed write

    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(descriptor)
        temporary = Path(name)
        write(temporary)
        os.replace(temporary, path)
    except (OSError, SafetensorError) as err:
        warnings.warn(f"cannot write the cache file {path} ({err}); the next load converts again", stacklevel=3)
    finally:
        if temporary is not None:
            temporary.unlink(missing_ok=True)  # gone already after a successful rename
