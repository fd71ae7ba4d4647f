"""Save a prefilled cache to disk and load it in another process (safetensors).

    save_cache("prefix.safetensors", cache, model, tokens=[prefix_ids])
    cache, tokens = load_cache("prefix.safetensors", model)      # another process

The file is plain safetensors: one tensor per array leaf of the cache, named by its path
in the pytree (``groups.0.keys``), and string metadata describing the rest:

* ``jaxkv.format``: ``"jaxkv.cache/1"``, the format and its version.
* ``jaxkv.structure``: the pytree as JSON: each node's class (``module:qualname``, only
  classes under ``jaxkv.`` are ever imported back), its static fields (window, layer
  types, a quantization spec, ...) and its children. Any cache whose nodes are
  dataclasses with static fields of numbers, strings, tuples or such dataclasses
  round-trips (quantized, linear, encoder-decoder layers too) with no change here.
* ``jaxkv.layer_types``: the per-layer types, checked against the loading model's.
* ``jaxkv.model``: the model class, its config (JSON) and a fingerprint of its weights
  (``weights_fingerprint``: a SHA-256 over every parameter's path, shape, dtype and every
  byte, so two models that differ in any one value never share a cache).
* ``jaxkv.tokens``: optionally, the token ids each row holds (JSON), so a loader can
  continue the right text.

On load every check names what differs and what to do: a different model config, other
weights, other layer types, or a file that is not a jaxkv cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import safetensors
import safetensors.numpy
from flax import nnx

FORMAT = "jaxkv.cache/1"


@dataclasses.dataclass(frozen=True)
class _Fingerprint:
    """A model's weights fingerprint and the weight arrays it holds for (weak references: a
    replaced weight is freed, and its reference then points at nothing)."""

    weights: tuple[weakref.ref, ...]
    digest: str

    def holds_for(self, weights: list[jax.Array]) -> bool:
        """Are ``weights`` exactly the arrays this fingerprint was taken of (none replaced)?"""
        return len(weights) == len(self.weights) and all(ref() is w for ref, w in zip(self.weights, weights))


# Each model's last fingerprint, so that a model whose weights did not change is hashed once (an
# engine's disk tier and every save_cache ask again); dropped with the model.
_FINGERPRINTS: weakref.WeakKeyDictionary[nnx.Module, _Fingerprint] = weakref.WeakKeyDictionary()


def _weights(model: nnx.Module) -> tuple[list[str], list[jax.Array]]:
    """The model's parameter paths and arrays, in the state's order."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    return [jax.tree_util.keystr(path) for path, _ in leaves], [leaf for _, leaf in leaves]


def remember_fingerprint(model: nnx.Module, digest: str) -> None:
    """Record ``digest`` as the fingerprint of ``model``'s weights as they are now: a loader that
    already hashed the file the weights came from (``jaxkv.models.load``: the converted-weights
    cache keeps the digest of every byte it holds) saves hashing them again. It holds until a
    weight array of the model is replaced (a fine-tuning step), then the weights are hashed."""
    _FINGERPRINTS[model] = _Fingerprint(tuple(weakref.ref(w) for w in _weights(model)[1]), digest)


def weights_fingerprint(model: nnx.Module) -> str:
    """The hex SHA-256 of every parameter's path, shape, dtype and bytes (``remember_fingerprint``'s
    digest while none of the arrays it was given for has been replaced)."""
    paths, weights = _weights(model)
    known = _FINGERPRINTS.get(model)
    if known is not None and known.holds_for(weights):
        return known.digest
    digest = arrays_digest(zip(paths, weights))
    remember_fingerprint(model, digest)
    return digest


def arrays_digest(named: Iterable[tuple[str, jax.Array | np.ndarray]]) -> str:
    """The hex SHA-256 of each ``(name, array)``'s name, shape, dtype and every byte, in order
    (about 0.5 s per GB)."""
    digest = hashlib.sha256()
    for name, array in named:
        digest.update(f"{name}{array.shape}{array.dtype}".encode())
        digest.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return digest.hexdigest()


def model_identity(model: nnx.Module) -> dict:
    """The model class, its config as JSON-able data and the fingerprint of its weights."""
    config = model.config
    if isinstance(config, pydantic.BaseModel):
        config = config.model_dump(mode="json")
    elif dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    config = json.loads(json.dumps(config, sort_keys=True, default=str))
    return {"class": type(model).__name__, "config": config, "weights": weights_fingerprint(model)}


def _describe(node, name: str, tensors: dict) -> dict:
    """JSON description of a pytree node; its arrays go to ``tensors`` under their path."""
    if node is None:
        return {"none": True}
    if isinstance(node, tuple | list):
        return {"tuple": [_describe(child, f"{name}.{i}", tensors) for i, child in enumerate(node)]}
    if isinstance(node, dict):  # keyed children (a container's shared views: empty between forwards)
        return {"dict": {str(key): _describe(child, f"{name}.{key}", tensors) for key, child in node.items()}}
    if dataclasses.is_dataclass(node):
        static, children = {}, {}
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            if field.metadata.get("pytree_node", True):
                children[field.name] = _describe(value, f"{name}.{field.name}" if name else field.name, tensors)
            else:
                static[field.name] = _encode_static(value)
        return {"class": _class_name(type(node)), "static": static, "children": children}
    tensors[name] = np.asarray(node)
    return {"tensor": name}


def _dict_key(key: str):
    """A dict child's key as saved (JSON keys are strings): integer keys come back as ints."""
    return int(key) if key.lstrip("-").isdigit() else key


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import_class(name: str, path: Path) -> type:
    """The class ``module:qualname`` names; only jaxkv's own classes are ever imported."""
    module, qualname = name.split(":")
    if module != "jaxkv" and not module.startswith("jaxkv."):
        raise ValueError(f"{path}: refusing to import {name}: cache classes must come from jaxkv")
    cls = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return cls


def _encode_static(value):
    """A static (non-array) field as JSON: numbers, strings, None, tuples, and dataclasses
    of those (e.g. a quantization spec)."""
    if dataclasses.is_dataclass(value):
        fields = {f.name: _encode_static(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"dataclass": _class_name(type(value)), "fields": fields}
    if isinstance(value, tuple | list):
        return [_encode_static(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot save a static cache field of type {type(value).__name__}: {value!r}")


def _decode_static(value, path: Path):
    """``_encode_static`` undone; JSON lists become tuples (static fields stay hashable)."""
    if isinstance(value, dict):
        fields = {key: _decode_static(v, path) for key, v in value["fields"].items()}
        return _import_class(value["dataclass"], path)(**fields)
    if isinstance(value, list):
        return tuple(_decode_static(v, path) for v in value)
    return value


def _build(description: dict, tensors, path: Path):
    """The pytree ``_describe`` described, with arrays read from ``tensors``."""
    if "none" in description:
        return None
    if "tuple" in description:
        return tuple(_build(child, tensors, path) for child in description["tuple"])
    if "dict" in description:
        return {_dict_key(key): _build(child, tensors, path) for key, child in description["dict"].items()}
    if "tensor" in description:
        return jnp.asarray(tensors.get_tensor(description["tensor"]))
    children = {key: _build(child, tensors, path) for key, child in description["children"].items()}
    static = {key: _decode_static(value, path) for key, value in description["static"].items()}
    return _import_class(description["class"], path)(**children, **static)


def save_cache(path: str | Path, cache, model: nnx.Module, *, tokens: Sequence[Sequence[int]] | None = None) -> None:
    """Write ``cache`` (built for ``model``) to ``path`` as safetensors; see the module docstring.

    ``tokens``: the token ids each row holds, stored so a loader can continue from them.
    """
    if tokens is not None and len(tokens) != cache.batch_size:
        raise ValueError(f"tokens has {len(tokens)} rows but the cache has {cache.batch_size}")
    tensors: dict[str, np.ndarray] = {}
    structure = _describe(cache, "", tensors)
    metadata = {
        "jaxkv.format": FORMAT,
        "jaxkv.structure": json.dumps(structure),
        "jaxkv.layer_types": json.dumps(list(cache.layer_types)),
        "jaxkv.model": json.dumps(model_identity(model), sort_keys=True),
    }
    if tokens is not None:
        metadata["jaxkv.tokens"] = json.dumps([[int(t) for t in row] for row in tokens])
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)


def _config_differences(saved: dict, current: dict) -> str:
    keys = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    return ", ".join(f"{k}: file {saved.get(k)!r} vs model {current.get(k)!r}" for k in keys[:8])


def _check_model(path: Path, saved: dict, current: dict) -> None:
    """The file's model identity must be the loading model's: class, config and weights."""
    if saved["class"] != current["class"] or saved["config"] != current["config"]:
        raise ValueError(
            f"{path}: the cache was saved for a {saved['class']} with another config than this "
            f"{current['class']} ({_config_differences(saved['config'], current['config'])}); "
            f"load it with the model it was saved for, or prefill again"
        )
    if saved["weights"] != current["weights"]:
        raise ValueError(
            f"{path}: the cache was saved for a model with the same config but other weights, or the same "
            f"weights in another dtype (fingerprint {saved['weights'][:12]} vs {current['weights'][:12]}); its "
            f"K/V do not apply here, prefill again with this model"
        )


def _check_layer_types(path: Path, file_types: list[str], model_types: list[str]) -> None:
    if file_types != model_types:
        first = next((i for i, (a, b) in enumerate(zip(file_types, model_types)) if a != b), None)
        where = f"; first at layer {first}: {file_types[first]} vs {model_types[first]}" if first is not None else ""
        raise ValueError(
            f"{path}: the file's layer types differ from the model's ({len(file_types)} vs {len(model_types)} "
            f"layers{where}); this cache cannot serve this model, prefill again"
        )


def load_cache(path: str | Path, model: nnx.Module):
    """Read a cache saved by ``save_cache`` for ``model``; returns ``(cache, tokens or None)``.

    Raises ``ValueError`` naming the difference when the file was saved for another model
    (class, config or weights) or with other layer types, or is not a jaxkv cache.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"cache file {path} does not exist")
    with safetensors.safe_open(str(path), framework="np") as tensors:
        metadata = tensors.metadata() or {}
        if metadata.get("jaxkv.format") != FORMAT:
            raise ValueError(
                f"{path}: not a jaxkv cache file of format {FORMAT} (found {metadata.get('jaxkv.format')!r}); "
                f"write it with jaxkv.persist.save_cache"
            )
        _check_model(path, json.loads(metadata["jaxkv.model"]), model_identity(model))
        model_types = list(jax.eval_shape(lambda: model.init_cache(1, 16)).layer_types)
        _check_layer_types(path, json.loads(metadata["jaxkv.layer_types"]), model_types)
        cache = _build(json.loads(metadata["jaxkv.structure"]), tensors, path)
    tokens = json.loads(metadata["jaxkv.tokens"]) if "jaxkv.tokens" in metadata else None
    return cache, tokens
