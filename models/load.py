"""One call from a model name or path to a ready model and its tokenizer.

``load_pretrained("smollm2")`` returns ``(model, tokenizer)``. ``Pretrained`` splits that call
so that a caller can look at the tokenizer (whether there is one, whether it has a chat
template) before the slow part, the weights.

A GGUF is converted once: its dequantized float32 weights (with the config) and its tokenizer
are cached as checksummed safetensors files under ``jaxkv.models.weight_cache.cache_dir()``,
keyed by the file's SHA-256 and ``CONVERTER_VERSION``, and later loads read those instead
(CPU time of a load: SmolLM2 ~1.4 s instead of ~7 s, Gemma 3 270M ~1.6 s instead of ~16 s).
Other dtypes are cast from the float32 copy. The cache also keeps the SHA-256 of every byte of
those weights, so a loaded model's weights fingerprint (``jaxkv.persist.weights_fingerprint``,
which names its disk tier and saved caches) costs nothing on a warm load.
``use_weight_cache=False`` (the CLI's ``--no-cache``) converts every time and touches no cache
file. A checkpoint directory is safetensors already and is read as it is.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from functools import cached_property
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from pydantic import ValidationError

from jaxkv.kernels.quantized import FORMATS, QuantizedMatrix, is_quantized, quantize, row_columns
from jaxkv.models.bart import Bart, BartConfig
from jaxkv.models.common import Decoder
from jaxkv.models.deepseek_v32 import DeepseekV32, DeepseekV32Config
from jaxkv.models.defaults import resolve_model
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.gemma4 import Gemma4, Gemma4Config
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.models.qwen3_5 import Qwen3_5, Qwen3_5Config
from jaxkv.models.tokenizer import Tokenizer
from jaxkv.models.weight_cache import cache_dir, discard, file_sha256, read_checked, write_checked
from jaxkv.models.weights import KEPT_PARAMS, CheckpointConfig, load_gguf, load_safetensors_checkpoint, open_gguf
from jaxkv.persist import arrays_digest, remember_fingerprint

# Bump whenever load_gguf or Tokenizer.from_gguf would give another result for the same file,
# or a config class reads its fields differently: older conversions are then not read.
CONVERTER_VERSION = 2  # 2: the weights' digest (``WEIGHTS_DIGEST``) is kept with them

WEIGHTS_DIGEST = "weights_sha256"  # the converted weights' metadata key of their digest
KEPT_FORMATS = "kept_formats"  # the kept blocks' metadata key: each kept parameter's format(s), JSON

# How a model's matrices are held (``load_pretrained(weights=...)``): "dense" arrays of ``dtype``;
# "gguf" the GGUF file's own blocks (``jaxkv.kernels.quantized``); "int8" / "int4" a float
# checkpoint's (or a GGUF's dequantized) matrices quantized at load: int8 as q8_0 (a float16 scale
# per group of 32 values of a row), int4 as q4_1 (a float16 scale and minimum per group of 32).
WEIGHTS = ("dense", "gguf", "int8", "int4")
QUANTIZE_FORMATS = {"int8": "q8_0", "int4": "q4_1"}

Model = Llama | Gemma3 | Gemma4 | Qwen3_5 | DeepseekV32 | Bart
MODEL_CLASSES: dict[type[CheckpointConfig], type[Model]] = {
    LlamaConfig: Llama, Gemma3Config: Gemma3, Qwen3_5Config: Qwen3_5, DeepseekV32Config: DeepseekV32, BartConfig: Bart,
    Gemma4Config: Gemma4,
}  # fmt: skip
CONFIG_CLASSES = {config_class.__name__: config_class for config_class in MODEL_CLASSES}


class Pretrained:
    """A model source (an embedded default's name, a GGUF file or a checkpoint directory)
    resolved to its file(s), whose ``tokenizer()`` and ``model()`` load separately. A GGUF's
    metadata (seconds to parse for a large vocabulary) is parsed at most once for both."""

    def __init__(self, name_or_path: str | Path, *, use_weight_cache: bool = True):
        self.path = resolve_model(name_or_path)
        self.use_weight_cache = use_weight_cache
        self.is_gguf = self.path.suffix == ".gguf"

    @cached_property
    def _reader(self):
        """The GGUF's reader, opened only to convert it; that takes seconds, so it is said first."""
        cached = f"; the result is cached in {cache_dir() / 'converted'}" if self.use_weight_cache else ""
        print(f"jaxkv: converting {self.path.name}{cached}", file=sys.stderr)
        return open_gguf(self.path)

    @cached_property
    def _cache_key(self) -> str:
        return f"{file_sha256(self.path)[:32]}-v{CONVERTER_VERSION}"

    def _cache_file(self, kind: str) -> Path | None:
        """Where this GGUF's converted ``kind`` ("weights", "tokenizer") is cached; None if caching is off."""
        return cache_dir() / "converted" / f"{self._cache_key}.{kind}.safetensors" if self.use_weight_cache else None

    def tokenizer(self, *, required: bool = False) -> Tokenizer | None:
        """The GGUF's tokenizer, or the checkpoint's ``tokenizer.json`` (with ``tokenizer_config.json``).

        A checkpoint without ``tokenizer.json`` gives None and a warning (the model itself
        works on token ids), or with ``required`` a ``FileNotFoundError`` saying what is missing."""
        if not self.is_gguf:
            return _checkpoint_tokenizer(self.path, required)
        cache_file = self._cache_file("tokenizer")
        cached = read_checked(cache_file) if cache_file else None
        if cached is not None:
            return Tokenizer.from_state(cached[1])
        tokenizer = Tokenizer.from_gguf(self.path, self._reader)
        if cache_file:
            write_checked(cache_file, {}, tokenizer.state())
        return tokenizer

    def model(
        self, dtype=jnp.float32, *, weights: str | None = None, mesh=None, rules=None, **model_kwargs
    ) -> Model:
        """The model ``MODEL_CLASSES`` gives for the config, its weights cast to ``dtype``.

        ``weights`` (``WEIGHTS``): "dense", or matrices and tables kept quantized: "gguf" (the GGUF's
        own blocks, no dequantization: the file's bytes are what a decode step reads) or "int8" /
        "int4" (quantized at load, ``QUANTIZE_FORMATS``); norms and biases stay dense (``dtype``).
        None (default): "gguf" for a GGUF file on one device (2.7x dense float32's batch-1 decode on
        SmolLM2 here; kept blocks do not shard over a mesh yet), else "dense".

        ``model_kwargs`` go to the model class (e.g. ``scan_layers=False`` for ``Llama``).
        ``mesh``, ``rules``: shard the weights over ``mesh`` (``jaxkv.sharding``). The weights
        reach the model as host arrays (a float32 tensor of the weight cache a view of its file
        map), and the model places each one: onto huge pages, or each device's share straight
        from the host, never gathered on one device first (``Decoder.param``)."""
        if weights is None:
            weights = "gguf" if self.is_gguf and mesh is None else "dense"
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        if weights == "gguf" and not self.is_gguf:
            raise ValueError(
                f"weights='gguf' keeps a GGUF file's blocks; {self.path} is a checkpoint: use int8 or int4"
            )
        host = lambda name, array: array if is_quantized(array) else np.asarray(array, dtype=jnp.dtype(dtype))  # noqa: E731
        digest = None
        if self.is_gguf:
            config, loaded, digest = self._gguf_blocks() if weights == "gguf" else self._gguf_float32()
            params = {name: host(name, array) for name, array in loaded.items()}
        else:
            config, params = load_safetensors_checkpoint(self.path, dtype, host)
        if weights in QUANTIZE_FORMATS:
            params, digest = _quantized(params, QUANTIZE_FORMATS[weights]), None
        model_class = MODEL_CLASSES[type(config)]
        if mesh is not None:
            if not issubclass(model_class, Decoder):
                raise ValueError(f"{model_class.__name__} models do not shard over a mesh yet; load them without mesh=")
            model_kwargs |= {"mesh": mesh, "rules": rules}
        model = model_class(config, params, **model_kwargs)
        if digest is not None:  # the weights are the cached ones, the dense ones cast to dtype: named by all
            named = f"{digest}:{jnp.dtype(dtype).name}:{weights}"
            remember_fingerprint(model, hashlib.sha256(named.encode()).hexdigest())
        return model

    def _gguf_blocks(self) -> tuple[CheckpointConfig, dict, str]:
        """The GGUF's config, its kept blocks (``QuantizedMatrix``) and float32 rest, and their
        digest: cached like ``_gguf_float32``, the blocks as uint8 tensors and their formats in the
        metadata (``KEPT_FORMATS``)."""
        cache_file = self._cache_file("blocks")
        cached = _read_weights(cache_file) if cache_file else None
        if cached is not None:
            config, tensors, digest, metadata = cached
            return config, _from_tensors(tensors, json.loads(metadata[KEPT_FORMATS])), digest
        host = lambda name, array: np.ascontiguousarray(array)  # noqa: E731
        config, params = load_gguf(self.path, jnp.float32, self._reader, progress=True, place=host, keep_blocks=True)
        tensors, formats = _to_tensors(params)
        digest = arrays_digest(sorted(tensors.items()))
        if cache_file:
            metadata = _metadata(config, digest, self.path) | {KEPT_FORMATS: json.dumps(formats)}
            write_checked(cache_file, tensors, metadata)
        return config, params, digest

    def _gguf_float32(self) -> tuple[CheckpointConfig, dict[str, np.ndarray], str]:
        """The GGUF's config, float32 host weights and their digest (``arrays_digest`` in name
        order): the cached conversion, or converted now (and cached).

        Cache entries are replaced by rename, never rewritten in place, so the memory-mapped
        pages stay valid while another process rebuilds one."""
        cache_file = self._cache_file("weights")
        cached = _read_weights(cache_file) if cache_file else None
        if cached is not None:
            return cached[:3]
        # Host arrays, contiguous as the cache file stores them (a transposed view would not be).
        host = lambda name, array: np.ascontiguousarray(array)  # noqa: E731
        config, params = load_gguf(self.path, jnp.float32, self._reader, progress=True, place=host)
        digest = arrays_digest(sorted(params.items()))
        if cache_file:
            write_checked(cache_file, params, _metadata(config, digest, self.path))
        return config, params, digest


def _metadata(config: CheckpointConfig, digest: str, source: Path) -> dict[str, str]:
    """A converted-weights cache file's metadata: the config (its class too), the digest, the GGUF."""
    return {"config_class": type(config).__name__, "config": config.model_dump_json(), WEIGHTS_DIGEST: digest,
            "source": str(source)}  # fmt: skip


def _quantized(params: dict, fmt: str) -> dict:
    """``params`` (dense, ``x @ w`` layout) with every matrix and table of ``KEPT_PARAMS`` whose rows
    split into ``fmt``'s blocks quantized to ``fmt`` (``[*layers, out, in]``); the rest as given."""
    values = FORMATS[fmt][0]
    kept = {}
    for name, array in params.items():
        table = name == "embed"
        if name in KEPT_PARAMS and not is_quantized(array) and array.shape[-1 if table else -2] % values == 0:
            rows = np.asarray(array, np.float32) if table else np.asarray(array, np.float32).swapaxes(-1, -2)
            array = quantize(rows, fmt)
        kept[name] = array
    return kept


def _to_tensors(params: dict) -> tuple[dict[str, np.ndarray], dict[str, str | list[str]]]:
    """``params`` as the tensors a safetensors file holds (a kept matrix: its blocks under its name)
    and each kept matrix's format(s)."""
    kept = {name: w for name, w in params.items() if is_quantized(w)}
    tensors = {name: np.asarray(w.blocks) if name in kept else w for name, w in params.items()}
    return tensors, {name: w.format if isinstance(w.format, str) else list(w.format) for name, w in kept.items()}


def _from_tensors(tensors: dict[str, np.ndarray], formats: dict[str, str | list[str]]) -> dict:
    """``_to_tensors``' inverse (the columns follow from a row's bytes and its format)."""
    params = dict(tensors)
    for name, fmt in formats.items():
        fmt = fmt if isinstance(fmt, str) else tuple(fmt)
        params[name] = QuantizedMatrix(tensors[name], fmt, row_columns(tensors[name].shape[-1], fmt))
    return params


def _read_weights(cache_file: Path) -> tuple[CheckpointConfig, dict[str, np.ndarray], str, dict] | None:
    """A cached conversion's config, weights, their digest and its metadata; None if there is none,
    it is corrupt, or it holds a config this code no longer reads (then it is converted again)."""
    entry = read_checked(cache_file)
    if entry is None:
        return None
    tensors, metadata = entry
    try:
        config = CONFIG_CLASSES[metadata["config_class"]].model_validate_json(metadata["config"])
        digest = metadata[WEIGHTS_DIGEST]
    except (KeyError, ValidationError) as err:
        return discard(cache_file, f"holds a config this version cannot read ({type(err).__name__}: {err})")
    return config, tensors, digest, metadata


def _checkpoint_tokenizer(directory: Path, required: bool) -> Tokenizer | None:
    """``directory``'s tokenizer; None with a warning, or an error if ``required``, without one."""
    tokenizer_json, tokenizer_config = directory / "tokenizer.json", directory / "tokenizer_config.json"
    if not tokenizer_json.is_file():
        problem = f"checkpoint {directory} has no tokenizer.json"
        if required:
            raise FileNotFoundError(
                f"{problem}, and text needs one: copy the model's tokenizer.json (and tokenizer_config.json) into it"
            )
        warnings.warn(f"{problem}: the model is loaded without a tokenizer (it takes token ids)", stacklevel=3)
        return None
    return Tokenizer.from_file(tokenizer_json, tokenizer_config if tokenizer_config.is_file() else None)


def load_pretrained(
    name_or_path: str | Path,
    dtype=jnp.float32,
    *,
    use_weight_cache: bool = True,
    **model_kwargs,
) -> tuple[Model, Tokenizer | None]:
    """``(model, tokenizer)`` for an embedded default's name (``smollm2``, ``gemma3``), a GGUF
    file or a HF checkpoint directory; see ``Pretrained.model`` for the arguments.

    The tokenizer is None (with a warning) for a checkpoint without ``tokenizer.json``.
    ``use_weight_cache=False``: convert a GGUF again rather than read or write the cache."""
    source = Pretrained(name_or_path, use_weight_cache=use_weight_cache)
    tokenizer = source.tokenizer()
    return source.model(dtype, **model_kwargs), tokenizer
