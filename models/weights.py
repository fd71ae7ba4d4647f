"""Load real checkpoints into the parameters of the models in ``jaxkv.models``.

Two sources, one parameter layout per model (its module's ``param_shapes``):

* a transformers checkpoint directory: ``config.json`` + ``model.safetensors`` (or a sharded
  ``model.safetensors.index.json``) -> ``load_safetensors_checkpoint`` (Llama, Mistral, Qwen2,
  Gemma 3, Qwen3.5, BART: ``HF_MODEL_TYPES``);
* a llama.cpp GGUF file (quantized or not) -> ``load_gguf`` (Llama, Gemma 3: ``GGUF_LOADERS``).

Both are read as "torch layout" tensors (``[out, in]`` for linear weights), checked by name and
shape against the config before any data is read, then transposed to ``x @ w`` layout and
stacked along a leading layer axis (BART reads its state dict through its own
``params_from_state_dict``). Every problem (missing file, corrupt file, missing, unexpected or
mis-shaped tensor) is a ``FileNotFoundError`` or ``ValueError`` naming it.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxkv.kernels.quantized import QuantizedMatrix, format_of, stack_layers
from jaxkv.models import bart, deepseek_v32, gemma3, gemma4, llama, qwen3_5
from jaxkv.models.bart import BartConfig
from jaxkv.models.deepseek_v32 import DeepseekV32Config
from jaxkv.models.gemma3 import Gemma3Config
from jaxkv.models.gemma4 import Gemma4Config
from jaxkv.models.llama import LlamaConfig
from jaxkv.models.qwen3_5 import Qwen3_5Config

DecoderOnlyConfig = LlamaConfig | Gemma3Config | Qwen3_5Config | DeepseekV32Config | Gemma4Config
CheckpointConfig = DecoderOnlyConfig | BartConfig

# Parameters stored as torch Linear weights ([out, in]); the model wants [in, out].
_TRANSPOSED = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "in_qkv", "in_z", "in_b", "in_a", "out"}
_TRANSPOSED |= {"wq_a", "wq_b", "wkv_a", "wkv_b", "iwq", "iwk", "iw", "router", "experts_gate", "experts_up"}
_TRANSPOSED |= {"experts_down", "shared_gate", "shared_up", "shared_down"}  # DeepSeek-V3.2
_TRANSPOSED |= gemma4.LAYER_MATRICES | {"ple_model_proj"}

# Our name -> transformers tensor name; "{i}" is the layer index. The names every decoder
# shares come first; each architecture adds or overrides its own.
_HF_DECODER = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight",
    "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight",
    "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
}
_HF_QK_NORMS = {
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}
# Our name -> llama.cpp tensor name, the same way.
_GGUF_DECODER = {
    "embed": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight",
    "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
}

# Llama family (transformers, and the "llama" GGUF architecture): optional q/k/v biases (Qwen2).
HF_NAMES = _HF_DECODER | {f"b{x}": f"model.layers.{{i}}.self_attn.{x}_proj.bias" for x in "qkv"}
GGUF_LLAMA_NAMES = _GGUF_DECODER | {f"b{x}": f"blk.{{i}}.attn_{x}.bias" for x in "qkv"}

# Gemma 3 (Gemma3ForCausalLM; "gemma3" GGUF): q/k norms and norms around attention and MLP.
# transformers' norms hold w, llama.cpp's 1 + w.
GEMMA3_HF_NAMES = (
    _HF_DECODER
    | _HF_QK_NORMS
    | {
        "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
        "mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "post_mlp_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
    }
)
GGUF_GEMMA3_NAMES = _GGUF_DECODER | {
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "post_attn_norm": "blk.{i}.post_attention_norm.weight",
    "post_mlp_norm": "blk.{i}.post_ffw_norm.weight",
}

# Gemma 4 text (Gemma4ForCausalLM): Gemma 3's names, the full-attention layers' weights again under
# "_full" and the double-wide MLPs' under "_wide" (their own stacks: jaxkv.models.gemma4.param_layers),
# the layer scalars, the per-layer embeddings and the mixture of experts.
GEMMA4_HF_NAMES = (
    GEMMA3_HF_NAMES
    | {f"{ours}_full": GEMMA3_HF_NAMES[ours] for ours in ("wq", "wk", "wv", "wo", "q_norm", "k_norm")}
    | {f"{ours}_wide": GEMMA3_HF_NAMES[ours] for ours in ("w_gate", "w_up", "w_down")}
    | {
        "layer_scalar": "model.layers.{i}.layer_scalar",
        "ple_gate": "model.layers.{i}.per_layer_input_gate.weight",
        "ple_proj": "model.layers.{i}.per_layer_projection.weight",
        "ple_norm": "model.layers.{i}.post_per_layer_input_norm.weight",
        "ple_embed": "model.embed_tokens_per_layer.weight",
        "ple_model_proj": "model.per_layer_model_projection.weight",
        "ple_proj_norm": "model.per_layer_projection_norm.weight",
        "post_mlp_norm_1": "model.layers.{i}.post_feedforward_layernorm_1.weight",
        "pre_moe_norm": "model.layers.{i}.pre_feedforward_layernorm_2.weight",
        "post_moe_norm": "model.layers.{i}.post_feedforward_layernorm_2.weight",
        "router": "model.layers.{i}.router.proj.weight",
        "router_scale": "model.layers.{i}.router.scale",
        "expert_scale": "model.layers.{i}.router.per_expert_scale",
        "moe_gate_up": "model.layers.{i}.experts.gate_up_proj",
        "moe_down": "model.layers.{i}.experts.down_proj",
    }
)

# Qwen3.5 text (Qwen3_5ForCausalLM): mixer weights exist only on the layers of their kind
# (see jaxkv.models.qwen3_5.param_layers).
QWEN3_5_HF_NAMES = _HF_DECODER | _HF_QK_NORMS | {
    ours: f"model.layers.{{i}}.linear_attn.{theirs}"
    for ours, theirs in (
        ("in_qkv", "in_proj_qkv.weight"), ("in_z", "in_proj_z.weight"), ("in_b", "in_proj_b.weight"),
        ("in_a", "in_proj_a.weight"), ("conv", "conv1d.weight"), ("dt_bias", "dt_bias"), ("A_log", "A_log"),
        ("gated_norm", "norm.weight"), ("out", "out_proj.weight"),
    )
}  # fmt: skip

# DeepSeek-V3.2 (DeepseekV32ForCausalLM): MLA + the DSA indexer, dense MLPs then MoEs. "{e}": one
# tensor per routed expert, stacked after the layer axis.
DEEPSEEK_V32_HF_NAMES = {
    name: _HF_DECODER[name] for name in ("embed", "norm", "lm_head", "attn_norm", "mlp_norm", "wo", "w_gate", "w_up", "w_down")
} | {
    ours: f"model.layers.{{i}}.{theirs}"
    for ours, theirs in (
        ("wq_a", "self_attn.q_a_proj.weight"), ("q_a_norm", "self_attn.q_a_layernorm.weight"),
        ("wq_b", "self_attn.q_b_proj.weight"), ("wkv_a", "self_attn.kv_a_proj_with_mqa.weight"),
        ("kv_a_norm", "self_attn.kv_a_layernorm.weight"), ("wkv_b", "self_attn.kv_b_proj.weight"),
        ("iwq", "self_attn.indexer.wq_b.weight"), ("iwk", "self_attn.indexer.wk.weight"),
        ("ik_norm", "self_attn.indexer.k_norm.weight"), ("ik_bias", "self_attn.indexer.k_norm.bias"),
        ("iw", "self_attn.indexer.weights_proj.weight"), ("router", "mlp.gate.weight"),
        ("router_bias", "mlp.gate.e_score_correction_bias"), ("experts_gate", "mlp.experts.{e}.gate_proj.weight"),
        ("experts_up", "mlp.experts.{e}.up_proj.weight"), ("experts_down", "mlp.experts.{e}.down_proj.weight"),
        ("shared_gate", "mlp.shared_experts.gate_proj.weight"), ("shared_up", "mlp.shared_experts.up_proj.weight"),
        ("shared_down", "mlp.shared_experts.down_proj.weight"),
    )
}  # fmt: skip

# Tensors some checkpoints carry that the model recomputes (old transformers saved RoPE tables).
_HF_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# Where a parameter goes as it is read: (our name, host array) -> a device array, or a host array
# for the model to place.
Placement = Callable[[str, np.ndarray], jax.Array | np.ndarray]


class _TensorSource(Protocol):
    """Named tensors in torch layout; ``shape`` must not read the data."""

    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def read(self, name: str) -> np.ndarray | jax.Array: ...


def _model_module(config: DecoderOnlyConfig):
    """The model module (``param_shapes``, ``layer_shapes``) a config belongs to."""
    modules = {Gemma3Config: gemma3, Gemma4Config: gemma4, Qwen3_5Config: qwen3_5, DeepseekV32Config: deepseek_v32}
    return modules.get(type(config), llama)


# The hybrid models stack each parameter over the layers of its kind only.
_PARAM_LAYERS = {qwen3_5: qwen3_5.param_layers, deepseek_v32: deepseek_v32.param_layers, gemma4: gemma4.param_layers}


def _plan(config: DecoderOnlyConfig, names: Mapping[str, str]) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """For each parameter, its source tensors (one per layer for stacked ones) and the
    torch-layout shape each must have."""
    module = _model_module(config)
    per_layer = module.layer_shapes(config)
    plan = {}
    for param, shape in module.param_shapes(config).items():
        if param in per_layer:
            shape = per_layer[param]
        source_shape = tuple(reversed(shape)) if param in _TRANSPOSED else tuple(shape)
        layers, experts = [None], [None]
        if param in per_layer:
            layers = _PARAM_LAYERS[module](config, param) if module in _PARAM_LAYERS else range(config.num_hidden_layers)
        if "{e}" in names[param]:  # one tensor per routed expert (DeepSeek-V3.2), stacked after the layers
            experts, source_shape = range(shape[0]), source_shape[:-1] if param in _TRANSPOSED else source_shape[1:]
        plan[param] = [(names[param].format(i=i, e=e), source_shape) for i in layers for e in experts]
    return plan


def _assemble(
    config: DecoderOnlyConfig,
    source: _TensorSource,
    names: Mapping[str, str],
    dtype: Any,
    *,
    what: str,
    ignored: Callable[[str], bool] = lambda name: False,
    fixups: Mapping[str, Callable[[np.ndarray | jax.Array], np.ndarray | jax.Array]] | None = None,
    progress: str | None = None,
    place: Placement | None = None,
    blocks: Callable[[str], tuple[str, np.ndarray] | None] | None = None,
) -> dict[str, jax.Array]:
    """Check every tensor's presence and shape first (cheap, and a clear error beats a
    half-loaded model), then read, fix up, transpose, stack and cast on the host, and hand
    each parameter to ``place`` (default: onto the default device); with ``progress``, a
    progress bar so described counts the tensors read on stderr.

    ``blocks(tensor name)``: a quantized tensor's format and its blocks ``[rows, row_bytes]``
    (None: not kept). A matrix or table (``KEPT_PARAMS``) whose every tensor ``blocks`` gives is
    kept as they are: a host ``QuantizedMatrix`` ``[*layers, out, in]`` (row fixups applied to the
    blocks' rows; no ``place``, no cast)."""
    plan = _plan(config, names)
    available = source.names()
    wanted = {name for sources in plan.values() for name, _ in sources}
    missing = sorted(wanted - available)
    if missing:
        raise ValueError(f"{what}: missing tensor(s) {_short_list(missing)}")
    unexpected = sorted(name for name in available - wanted if not ignored(name))
    if unexpected:
        raise ValueError(f"{what}: unexpected tensor(s) {_short_list(unexpected)} (not part of this model's config)")
    for sources in plan.values():
        for name, expected in sources:
            actual = source.shape(name)
            if actual != expected:
                raise ValueError(f"{what}: tensor {name!r} has shape {actual}, expected {expected}")

    fixups = fixups or {}
    per_layer = _model_module(config).layer_shapes(config)
    shapes = _model_module(config).param_shapes(config)
    place = place or (lambda param, array: jnp.asarray(array))
    params = {}
    with tqdm(total=len(wanted), desc=progress, unit="tensor", file=sys.stderr, disable=progress is None) as bar:
        for param, sources in plan.items():
            kept = _kept_blocks(param, sources, blocks, fixups.get(param), stacked=param in per_layer)
            if kept is not None:
                params[param] = kept
                bar.update(len(sources))
                continue
            arrays = []
            for name, _ in sources:
                array = source.read(name)
                if param in fixups:
                    array = fixups[param](array)
                array = np.asarray(array).astype(jnp.dtype(dtype))
                arrays.append(array.T if param in _TRANSPOSED else array)
                bar.update()
            stacked = np.stack(arrays).reshape(shapes[param]) if param in per_layer else arrays[0]
            params[param] = place(param, stacked)
    return params


# The parameters a GGUF's blocks may stay in (``blocks=`` of ``_assemble``): the tables and the layer
# matrices of the GGUF architectures; norms and biases are read as float32.
KEPT_PARAMS = frozenset({"embed", "lm_head"} | set(llama.LAYER_MATRICES) | set(gemma3.LAYER_MATRICES))


def _kept_blocks(param: str, sources, blocks, fixup, *, stacked: bool):
    """``param``'s tensors ``sources`` as one host ``QuantizedMatrix`` (stacked over its layers when
    ``stacked``), or None when it is not kept (``blocks`` is None, ``param`` is no ``KEPT_PARAMS``, or
    a tensor is not in a kept format)."""
    if blocks is None or param not in KEPT_PARAMS:
        return None
    read = [blocks(name) for name, _ in sources]
    if any(entry is None for entry in read):
        return None
    formats = [fmt for fmt, _ in read]
    rows = [np.ascontiguousarray(fixup(data) if fixup else data) for _, data in read]
    columns = sources[0][1][-1]  # torch layout [out, in]
    return stack_layers(formats, rows, columns) if stacked else QuantizedMatrix(rows[0], formats[0], columns)


def _short_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---------------------------------------------------------------------------------------------
# transformers checkpoints (safetensors)


class _SafetensorsSource:
    """Tensors spread over one or more safetensors files, opened lazily via ``safe_open``.

    framework="flax" because numpy has no bfloat16, the usual checkpoint dtype."""

    def __init__(self, files: Mapping[str, Path], stack: contextlib.ExitStack):
        from safetensors import SafetensorError, safe_open

        self._handles: dict[str, Any] = {}  # tensor name -> open file
        for path in sorted(set(files.values())):
            try:
                handle = stack.enter_context(safe_open(path, framework="flax"))
            except (SafetensorError, OSError) as err:
                raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {err}") from err
            for name in handle.keys():
                self._handles[name] = handle
        listed = {name for name in files if name is not None}  # None: an unsharded file
        not_found = sorted(listed - set(self._handles))
        if not_found:
            raise ValueError(f"safetensors index lists tensor(s) its shard files lack: {_short_list(not_found)}")

    def names(self) -> set[str]:
        return set(self._handles)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def read(self, name: str) -> jax.Array:
        return self._handles[name].get_tensor(name)


def _checkpoint_files(directory: Path) -> dict[str | None, Path]:
    """Tensor name -> file for a sharded checkpoint, or ``{None: file}`` for a single file."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return {None: single}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index} is not a safetensors index (no valid 'weight_map'): {err}") from err
        files = {name: directory / shard for name, shard in weight_map.items()}
        absent = sorted({str(p) for p in files.values() if not p.is_file()})
        if absent:
            raise FileNotFoundError(f"shard file(s) listed in {index} not found: {_short_list(absent)}")
        return files
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {directory} "
        "(only safetensors checkpoints are supported, not pytorch_model.bin)"
    )


# config.json model_type -> the config class that reads it.
HF_MODEL_TYPES: dict[str, type[CheckpointConfig]] = {
    "llama": LlamaConfig,
    "mistral": LlamaConfig,
    "qwen2": LlamaConfig,
    "gemma3_text": Gemma3Config,
    "gemma4_text": Gemma4Config,
    "qwen3_5_text": Qwen3_5Config,
    "deepseek_v32": DeepseekV32Config,
    "bart": BartConfig,
}


def read_hf_config(directory: str | Path) -> CheckpointConfig:
    """The config class ``HF_MODEL_TYPES`` names for a checkpoint's ``config.json``, read from it."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    model_type = raw.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(HF_MODEL_TYPES)}")
    if model_type == "qwen2":
        # Qwen2's q/k/v projections always have a bias, but its config.json does not say so.
        raw.setdefault("attention_bias", True)
    return HF_MODEL_TYPES[model_type].model_validate(raw)


def load_safetensors_checkpoint(
    directory: str | Path, dtype: Any = jnp.float32, place: Placement | None = None
) -> tuple[CheckpointConfig, dict[str, jax.Array]]:
    """``(config, params)`` from a transformers checkpoint directory (``HF_MODEL_TYPES``: Llama,
    Mistral, Qwen2, Gemma 3 text, Gemma 4 text, Qwen3.5 text, BART).

    ``params`` is named and shaped as the model module's ``param_shapes(config)`` gives
    (``jaxkv.models.llama``, ``gemma3``, ``qwen3_5`` or ``bart``), cast to ``dtype``.
    ``place(name, host_array)``: where each decoder parameter goes as it is read (sharded over
    a mesh: ``Pretrained.model``); BART's are read whole.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    config = read_hf_config(directory)
    files = _checkpoint_files(directory)
    if isinstance(config, BartConfig):  # two layer stacks and tied copies: BART reads its state dict itself
        with contextlib.ExitStack() as stack:
            source = _SafetensorsSource(files, stack)
            tensors = {name: source.read(name) for name in source.names()}
            return config, bart.params_from_state_dict(config, tensors, dtype)
    names = {Gemma3Config: GEMMA3_HF_NAMES, Qwen3_5Config: QWEN3_5_HF_NAMES, DeepseekV32Config: DEEPSEEK_V32_HF_NAMES}
    names |= {Gemma4Config: GEMMA4_HF_NAMES}
    names = names.get(type(config), HF_NAMES)

    def ignored(name: str) -> bool:
        # A tied checkpoint may still carry lm_head.weight: it is the embedding again.
        return name.endswith(_HF_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == names["lm_head"])

    with contextlib.ExitStack() as stack:
        source = _SafetensorsSource(files, stack)
        params = _assemble(config, source, names, dtype, what=str(directory), ignored=ignored, place=place)
    return config, params


# ---------------------------------------------------------------------------------------------
# GGUF


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` for ``path``, with a clear error for a missing or non-GGUF file."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # the reader fails with assorted numpy errors on a cut-off file
        raise ValueError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {type(err).__name__}: {err}"
        ) from err


_NO_DEFAULT = object()


def gguf_value(reader, key: str, default: Any = _NO_DEFAULT) -> Any:
    """A metadata value (str, number, bool, or list for arrays)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _NO_DEFAULT:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


class _GGUFSource:
    """GGUF tensors, dequantized to float32 on read."""

    def __init__(self, reader):
        self._tensors = {t.name: t for t in reader.tensors}

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        # ggml lists dimensions fastest-first ([in, out]); numpy/torch order is the reverse.
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def read(self, name: str) -> np.ndarray:
        import gguf

        tensor = self._tensors[name]
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(self.shape(name)).astype(np.float32)

    def blocks(self, name: str) -> tuple[str, np.ndarray] | None:
        """A 2-D tensor's format and blocks ``[rows, row_bytes]`` (a view of the file map), or None
        when its type is not one ``jaxkv.kernels.quantized`` computes with (F32, F16...)."""
        tensor = self._tensors[name]
        fmt = format_of(tensor.tensor_type)
        return None if fmt is None or len(tensor.shape) != 2 else (fmt, np.asarray(tensor.data))


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: ``[H*D, ...]`` -> ``[H*D, ...]``.

    llama.cpp's converter reorders each head's rows from half-split RoPE order (dims
    ``0..D/2-1`` pair with ``D/2..D-1``) to interleaved order (dim ``2j`` pairs with ``2j+1``),
    because ggml rotates adjacent pairs. ``jaxkv.models.llama`` rotates halves like transformers, so
    each head's rows, seen as ``[D/2, 2]`` pairs, are transposed back to ``[2, D/2]``.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_decoder_fields(reader, arch: str, tensor_shapes: Mapping[str, tuple[int, ...]], *, rms_eps, context):
    """Config fields every decoder reads alike from ``{arch}.*`` metadata (llama.cpp's
    key names), after the checks all loaders need. Returns ``(fields, meta, rope scaling type)``."""

    def meta(key, default=_NO_DEFAULT):
        return gguf_value(reader, f"{arch}.{key}", default)

    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("GGUF: missing tensor 'token_embd.weight'")
    scaling_type = meta("rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported (none or linear only)")
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    fields = dict(
        vocab_size=tensor_shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", rms_eps)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        max_position_embeddings=int(meta("context_length", context)),
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=gguf_value(reader, "tokenizer.ggml.eos_token_id", None),
    )
    return fields, meta, scaling_type


def _llama_gguf_config(reader, tensor_shapes: Mapping[str, tuple[int, ...]]) -> LlamaConfig:
    """``LlamaConfig`` from the ``llama.*`` metadata."""
    fields, meta, scaling_type = _gguf_decoder_fields(reader, "llama", tensor_shapes, rms_eps=1e-5, context=2048)
    if "rope_freqs.weight" in tensor_shapes:
        raise ValueError("GGUF has rope_freqs.weight (Llama 3.1-style frequency factors), which is not supported yet")
    rotary = int(meta("rope.dimension_count", fields["head_dim"]))
    if rotary != fields["head_dim"]:
        raise ValueError(
            f"GGUF rope.dimension_count {rotary} != head dim {fields['head_dim']}: partial RoPE is not supported"
        )
    scaling = {"type": "linear", "factor": float(meta("rope.scaling.factor"))} if scaling_type == "linear" else None
    return LlamaConfig(
        **fields,
        rope_theta=float(meta("rope.freq_base", 10_000.0)),
        rope_scaling=scaling,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
    )


def _gemma3_gguf_config(reader, tensor_shapes: Mapping[str, tuple[int, ...]]) -> Gemma3Config:
    """``Gemma3Config`` from the ``gemma3.*`` metadata.

    The file lacks what llama.cpp hard-codes for gemma3 (local RoPE base 10000, every 6th
    layer global, query scale head_dim ** -0.5, no soft-capping); those come from
    ``Gemma3Config``'s defaults, as transformers fills them from ``Gemma3TextConfig``'s."""
    fields, meta, scaling_type = _gguf_decoder_fields(reader, "gemma3", tensor_shapes, rms_eps=1e-6, context=131_072)
    full_rope = {"rope_theta": float(meta("rope.freq_base", 1_000_000.0))}
    if scaling_type == "linear":  # llama.cpp scales the global layers only
        full_rope |= {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    return Gemma3Config(
        **fields,
        rope_parameters={"full_attention": full_rope},  # sliding layers: the default base 10000
        sliding_window=int(meta("attention.sliding_window")),
        query_pre_attn_scalar=fields["head_dim"],
    )


def _llama_gguf_fixups(config: LlamaConfig) -> dict:
    """llama.cpp permutes Q/K rows for its interleaved RoPE; ours rotates halves (as HF)."""
    return {
        "wq": lambda w: unpermute_rope_rows(w, config.num_attention_heads),
        "wk": lambda w: unpermute_rope_rows(w, config.kv_heads),
    }


def _gemma3_gguf_fixups(config: Gemma3Config) -> dict:
    """llama.cpp stores Gemma's norm weights as the multiplier 1 + w; ours hold w (as HF).
    Gemma's Q/K rows are not permuted (ggml's NeoX-style RoPE rotates halves, as we do)."""
    return {name: (lambda w: w - 1.0) for name in GGUF_GEMMA3_NAMES if name == "norm" or name.endswith("_norm")}


# general.architecture -> (config from metadata, tensor names, per-tensor fixups).
GGUF_LOADERS: dict[str, tuple[Callable, Mapping[str, str], Callable]] = {
    "llama": (_llama_gguf_config, GGUF_LLAMA_NAMES, _llama_gguf_fixups),
    "gemma3": (_gemma3_gguf_config, GGUF_GEMMA3_NAMES, _gemma3_gguf_fixups),
}


def load_gguf(
    path: str | Path, dtype: Any = jnp.float32, reader=None, *, progress: bool = False, place: Placement | None = None,
    keep_blocks: bool = False,
) -> tuple[DecoderOnlyConfig, dict[str, jax.Array]]:  # fmt: skip
    """``(config, params)`` from a GGUF file, dequantized (via float32) to ``dtype``; with
    ``keep_blocks``, its quantized matrices and tables stay in their blocks (``QuantizedMatrix``
    ``[*layers, out, in]``, host arrays; ``KEPT_PARAMS``), the rest dequantized.

    ``params`` is named and shaped as the model module's ``param_shapes(config)`` gives
    (``jaxkv.models.llama`` for "llama" files, ``jaxkv.models.gemma3`` for "gemma3"). ``reader``: the
    file's ``open_gguf`` reader if the caller has one (parsing a large vocabulary's
    metadata takes seconds; the tokenizer reads the same file). ``progress``: show a
    progress bar on stderr (dequantizing takes seconds). ``place``: see ``load_safetensors_checkpoint``.
    """
    path = Path(path)
    reader = reader or open_gguf(path)
    architecture = gguf_value(reader, "general.architecture")
    if architecture not in GGUF_LOADERS:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported yet; supported: {sorted(GGUF_LOADERS)}"
        )
    make_config, names, fixups = GGUF_LOADERS[architecture]
    source = _GGUFSource(reader)
    config = make_config(reader, {name: source.shape(name) for name in source.names()})
    what, description = str(path), f"converting {path.name}" if progress else None
    return config, _assemble(
        config, source, names, dtype, what=what, fixups=fixups(config), progress=description, place=place,
        blocks=source.blocks if keep_blocks else None,
    )  # fmt: skip
