"""Gemma 4 text decoder (e.g. Gemma 4 E2B / E4B) in one readable file, on the pieces of
``jaxkv.models.common``; what it adds to ``jaxkv.models.gemma3``:

* K/V shared across layers: the last ``num_kv_shared_layers`` layers have no K/V projections
  and attend over the K/V of the last earlier layer of their type (``Cache.kv_sources``: the
  cache holds no storage for them; ``cached_attention`` with ``keys = values = None``). With
  ``use_double_wide_mlp`` those layers' MLPs are twice as wide.
* Per-layer-type head shapes: full-attention layers have ``global_head_dim`` (and, where the
  config says so, their own K/V head count), their own RoPE ("proportional": only the first
  ``partial_rotary_factor`` of each head rotates) and the cache stores them at that shape.
* Per-layer embeddings (PLE): a second embedding of the tokens, ``hidden_size_per_layer_input``
  values per layer, mixed with a projection of the main embedding, feeds a gated residual at
  the end of every layer.
* Norms multiply by their weight (not Gemma 3's ``1 + w``), values get a scale-free RMSNorm,
  attention is unscaled (the q/k norms set the logits' scale), and each layer's output is
  multiplied by its ``layer_scalar``.

Follow one token: ``embed * sqrt(hidden)`` and its per-layer inputs -> for each layer: RMSNorm
-> q (and, in a storing layer, k, v) projections -> per-head q/k norms, v's plain norm -> RoPE
of the layer's type -> ``cached_attention`` -> output projection -> RMSNorm -> residual ->
RMSNorm -> GeGLU MLP -> RMSNorm -> residual -> the gated per-layer input -> ``* layer_scalar``;
then the final RMSNorm, the tied LM head and an optional logit soft-cap.

The layers run unrolled (each layer's kind, weight shapes and K/V source are static), so
compile time grows with depth. A prefill that asks for some positions' logits (``logits_index``)
runs the layers that reuse K/V on those positions only (they write nothing), as transformers
does. Variants this file does not implement are refused by name: bidirectional attention,
attention biases. The mixture of experts (``enable_moe_block``, Gemma 4 26B-A4B) is a dense
reference: every expert runs on every token, weighted by the router's top-k. ``attention_k_eq_v``
(Gemma 4 31B) is implemented: full-attention layers have no value projection and take the key
projection (before the key norm and RoPE) as their values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxkv.models.common import (
    Decoder,
    DecoderConfig,
    apply_rope,
    check_num_layers,
    checked_params,
    decoder_param_axes,
    decoder_param_shapes,
    inverse_frequencies,
    rms_norm,
)  # fmt: skip
from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, model_validator

from jaxkv.attention import cached_attention
from jaxkv.cache import Cache, kv_sources_of
from jaxkv.sharding import BATCH, EMBED, HEAD_DIM, KV_HEADS, MLP, Q_HEADS, VOCAB, Axes

SLIDING, FULL = "sliding_attention", "full_attention"
# Weights that differ by a layer's attention type carry its suffix (full layers: their own head dim).
KIND_SUFFIX = {SLIDING: "", FULL: "_full"}


class RopeParameters(BaseModel):
    """RoPE of one layer type: 'default', or 'proportional' (the first ``partial_rotary_factor``
    of each head's dimensions rotate, at frequencies of the whole head dim; the rest do not)."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # hashable: the config is static under jit
    rope_type: str = "default"
    rope_theta: float = 10_000.0
    factor: float = 1.0
    partial_rotary_factor: float = 1.0

    @model_validator(mode="after")
    def supported(self):
        if self.rope_type not in ("default", "proportional"):
            raise ValueError(f"Gemma 4 rope_type {self.rope_type!r} is not supported; use default or proportional")
        return self


class LayerRope(BaseModel):
    """transformers' per-layer-type ``rope_parameters`` of a Gemma 4 config (its defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    sliding_attention: RopeParameters = RopeParameters(rope_theta=10_000.0)
    full_attention: RopeParameters = RopeParameters(
        rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1_000_000.0
    )


class Gemma4Config(DecoderConfig):
    """The fields of a HF ``Gemma4TextConfig`` (``config.json``) this model reads, with its defaults."""

    num_key_value_heads: PositiveInt = 4
    head_dim: PositiveInt = 256
    # Full-attention layers' head dim and K/V heads (transformers' per_layer_config); None: as the others.
    global_head_dim: PositiveInt | None = None
    num_global_key_value_heads: PositiveInt | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: PositiveInt = 131_072
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    rope_parameters: LayerRope = LayerRope()
    sliding_window: PositiveInt = 512
    layer_types: tuple[str, ...]
    final_logit_softcapping: float | None = None
    hidden_size_per_layer_input: NonNegativeInt = 256  # 0: no per-layer embeddings
    vocab_size_per_layer_input: PositiveInt = 262_144
    num_kv_shared_layers: NonNegativeInt = 0
    use_double_wide_mlp: bool = False
    attention_k_eq_v: bool = False  # full-attention layers' values are their keys' projection
    # A mixture of experts beside every layer's MLP (Gemma 4 26B-A4B).
    enable_moe_block: bool = False
    num_experts: PositiveInt | None = None
    top_k_experts: PositiveInt | None = None
    moe_intermediate_size: PositiveInt | None = None

    @model_validator(mode="before")
    @classmethod
    def from_hf_names(cls, data):
        """Read transformers' ``per_layer_config`` (the full-attention layers' head dim and K/V
        heads), fill ``layer_types`` as transformers does, and refuse what this model does not
        implement instead of ignoring it."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("layer_types") is None:  # transformers: every 6th layer global
            data["layer_types"] = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(data["num_hidden_layers"])]
        layer_types = list(data["layer_types"])
        if set(layer_types) - {SLIDING, FULL}:
            raise ValueError(f"Gemma 4 layer types {sorted(set(layer_types) - {SLIDING, FULL})} are not supported")
        layer_types[-1] = FULL  # transformers forces the last layer global (with a warning)
        data["layer_types"] = layer_types
        data.update(_global_shapes(data.pop("per_layer_config", None), layer_types, data))
        if data.get("enable_moe_block") and not all(
            data.get(key) for key in ("num_experts", "top_k_experts", "moe_intermediate_size")
        ):
            raise ValueError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        refused = {
            "use_bidirectional_attention": "bidirectional attention",
            "attention_bias": "attention biases",
        }
        for key, what in refused.items():
            if data.get(key):
                raise ValueError(f"{key}={data[key]!r}: {what} are not supported by jaxkv.models.gemma4")
        activation = data.get("hidden_activation") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {activation!r} is not supported by jaxkv.models.gemma4 (gelu tanh)")
        return data

    def kind_shape(self, kind: str) -> tuple[int, int]:
        """``(K/V heads, head dim)`` of the layers of type ``kind``."""
        if kind == FULL:
            return self.num_global_key_value_heads or self.num_key_value_heads, self.global_head_dim or self.head_dim
        return self.num_key_value_heads, self.head_dim

    @property
    def per_layer_config(self) -> dict[int, dict[str, int]]:
        """transformers' per-layer overrides (``Cache.from_config`` sizes each layer type by them)."""
        heads, dim = self.kind_shape(FULL)
        full = [i for i, kind in enumerate(self.layer_types) if kind == FULL]
        return {i: {"num_key_value_heads": heads, "head_dim": dim} for i in full}

    @property
    def kv_sources(self) -> tuple[int, ...]:
        """Per layer, the layer whose K/V it attends over (``jaxkv.cache.kv_sources_of``)."""
        return kv_sources_of(self, self.layer_types) or tuple(range(self.num_hidden_layers))


def _global_shapes(per_layer_config, layer_types: list[str], data: dict) -> dict:
    """``global_head_dim`` and ``num_global_key_value_heads`` from transformers' ``per_layer_config``
    (by layer index: only full-attention layers, all alike); without one, as transformers derives
    them (a global head dim of 512 by default, the global K/V heads under ``attention_k_eq_v``)."""
    if per_layer_config is None:  # as transformers' Gemma4TextConfig builds it
        heads = data.get("num_global_key_value_heads") if data.get("attention_k_eq_v") else None
        return {"global_head_dim": data.get("global_head_dim", 512), "num_global_key_value_heads": heads}
    overrides = {}
    for index, layer in per_layer_config.items():
        if layer_types[int(index)] != FULL or set(layer) - {"head_dim", "num_key_value_heads"}:
            raise ValueError(f"per_layer_config[{index}] = {layer}: Gemma 4 overrides full-attention head shapes only")
        if overrides.setdefault("layer", layer) != layer:
            raise ValueError(f"per_layer_config gives full-attention layers different shapes: {per_layer_config}")
    layer = overrides.get("layer", {})
    return {"global_head_dim": layer.get("head_dim"), "num_global_key_value_heads": layer.get("num_key_value_heads")}


def rope_frequencies(rope: RopeParameters, head_dim: int) -> jax.Array:
    """Inverse frequencies ``[D/2]`` of one layer type; proportional RoPE's unrotated tail is 0."""
    if rope.rope_type == "default":
        return inverse_frequencies(rope.rope_theta, head_dim)
    angles = int(rope.partial_rotary_factor * head_dim // 2)
    rotated = 1.0 / rope.rope_theta ** (jnp.arange(0, 2 * angles, 2, dtype=jnp.float32) / head_dim)
    return jnp.concatenate([rotated, jnp.zeros(head_dim // 2 - angles, jnp.float32)]) / rope.factor


# --- parameters: each stacked over the layers that have it ----------------------------------
def _stores(config: Gemma4Config, layer: int) -> bool:
    return config.kv_sources[layer] == layer


def _keys_as_values(config: Gemma4Config, kind: str) -> bool:
    """Whether layers of type ``kind`` take their keys' projection as values (``attention_k_eq_v``)."""
    return config.attention_k_eq_v and kind == FULL


def _wide(config: Gemma4Config, layer: int) -> bool:
    """A layer with a double-wide MLP: one that reuses K/V, when the config asks for them."""
    return config.use_double_wide_mlp and not _stores(config, layer)


def _first_reusing(config: Gemma4Config) -> int | None:
    """The first layer that reuses K/V (every later one does too); None when every layer stores its own."""
    return next((i for i in range(config.num_hidden_layers) if not _stores(config, i)), None)


def _at_logits_positions(logits_index: jax.Array, *arrays: jax.Array | None) -> tuple:
    """Each of ``arrays`` (``[B, T, ...]``, or None) at positions ``logits_index`` (``[B]``, or ``[B, K]``)
    only: ``[B, 1, ...]`` (``[B, K, ...]``)."""
    index = logits_index if logits_index.ndim == 2 else logits_index[:, None]

    def taken(array):
        return jnp.take_along_axis(array, index.reshape(*index.shape, *[1] * (array.ndim - 2)), axis=1)

    return tuple(None if array is None else taken(array) for array in arrays)


def _layer_params(config: Gemma4Config) -> dict[str, tuple[tuple[int, ...], Axes, list[int]]]:
    """Per-layer weight -> (shape without the layer axis, logical axes, the model layers it is
    stacked over, in order); ``x @ w`` layout."""
    d, ff, p = config.hidden_size, config.intermediate_size, config.hidden_size_per_layer_input
    every = list(range(config.num_hidden_layers))
    params = {
        name: ((d,), Axes(EMBED), every) for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")
    }
    params["layer_scalar"] = ((1,), Axes(None), every)
    if p:
        params |= {
            "ple_gate": ((d, p), Axes(EMBED, None), every),
            "ple_proj": ((p, d), Axes(None, EMBED), every),
            "ple_norm": ((d,), Axes(EMBED), every),
        }
    for kind, suffix in KIND_SUFFIX.items():
        kv_heads, dim = config.kind_shape(kind)
        q, kv = config.num_attention_heads * dim, kv_heads * dim
        layers = [i for i in every if config.layer_types[i] == kind]
        storing = [i for i in layers if _stores(config, i)]
        params |= {
            f"wq{suffix}": ((d, q), Axes(EMBED, Q_HEADS), layers),
            f"q_norm{suffix}": ((dim,), Axes(HEAD_DIM), layers),
            f"wo{suffix}": ((q, d), Axes(Q_HEADS, EMBED), layers),
            f"wk{suffix}": ((d, kv), Axes(EMBED, KV_HEADS), storing),
            f"wv{suffix}": ((d, kv), Axes(EMBED, KV_HEADS), [] if _keys_as_values(config, kind) else storing),
            f"k_norm{suffix}": ((dim,), Axes(HEAD_DIM), storing),
        }
    for suffix, width, layers in (
        ("", ff, [i for i in every if not _wide(config, i)]),
        ("_wide", 2 * ff, [i for i in every if _wide(config, i)]),
    ):
        params |= {
            f"w_gate{suffix}": ((d, width), Axes(EMBED, MLP), layers),
            f"w_up{suffix}": ((d, width), Axes(EMBED, MLP), layers),
            f"w_down{suffix}": ((width, d), Axes(MLP, EMBED), layers),
        }
    if config.enable_moe_block:
        experts, width = config.num_experts, config.moe_intermediate_size
        norms = ("post_mlp_norm_1", "router_scale", "pre_moe_norm", "post_moe_norm")
        params |= {name: ((d,), Axes(EMBED), every) for name in norms} | {
            "router": ((d, experts), Axes(EMBED, None), every),
            "expert_scale": ((experts,), Axes(None), every),
            "moe_gate_up": ((experts, 2 * width, d), Axes(None, MLP, EMBED), every),  # as transformers stores them
            "moe_down": ((experts, d, width), Axes(None, EMBED, MLP), every),
        }
    return {name: entry for name, entry in params.items() if entry[2]}


LAYER_MATRICES = {
    f"{name}{suffix}" for name in ("wq", "wk", "wv", "wo") for suffix in KIND_SUFFIX.values()
} | {f"{name}{suffix}" for name in ("w_gate", "w_up", "w_down") for suffix in ("", "_wide")}
LAYER_MATRICES |= {"ple_gate", "ple_proj", "router"}


def layer_shapes(config: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Per-layer weight names and shapes (without the leading layer axis); ``x @ w`` layout."""
    return {name: shape for name, (shape, _, _) in _layer_params(config).items()}


def param_layers(config: Gemma4Config, name: str) -> list[int]:
    """The model layers per-layer weight ``name`` is stacked over, in order (the loader reads them)."""
    return _layer_params(config)[name][2]


def _ple_shapes(config: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """The per-layer embedding's table, the projection of the main embedding, and its norm."""
    if not config.hidden_size_per_layer_input:
        return {}
    packed = config.num_hidden_layers * config.hidden_size_per_layer_input
    return {
        "ple_embed": (config.vocab_size_per_layer_input, packed),
        "ple_model_proj": (config.hidden_size, packed),
        "ple_proj_norm": (config.hidden_size_per_layer_input,),
    }


def param_shapes(config: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape; per-layer ones carry a leading axis over their layers."""
    stacked = {name: len(layers) for name, (_, _, layers) in _layer_params(config).items()}
    return decoder_param_shapes(config, layer_shapes(config), stacked) | _ple_shapes(config)


def param_axes(config: Gemma4Config) -> dict[str, Axes]:
    """Every parameter's logical axes, as ``param_shapes`` names them."""
    per_layer = {name: axes for name, (_, axes, _) in _layer_params(config).items()}
    ple = {"ple_embed": Axes(VOCAB, None), "ple_model_proj": Axes(EMBED, None), "ple_proj_norm": Axes(None)}
    return decoder_param_axes(config, per_layer) | {name: ple[name] for name in _ple_shapes(config)}


class Gemma4(Decoder):
    """``logits, cache = model(tokens [B, T], positions [B, T], cache)``; positions < 0 are padding."""

    def __init__(
        self, config: Gemma4Config, params: dict | None = None, *, dtype=jnp.float32, seed: int = 0, mesh=None,
        rules=None, weight_layout: str = "out_in",
    ):  # fmt: skip
        """``params``: arrays named as ``param_shapes`` gives (per-layer weights stacked over the
        layers that have them, ``param_layers``; ``x @ w`` layout); random if None. ``mesh``,
        ``rules``, ``weight_layout``: as ``Gemma3``'s."""
        params = checked_params("Gemma4", param_shapes(config), params, dtype=dtype, seed=seed, norm_value=1.0)
        axes = param_axes(config)
        super().__init__(config, params, axes, mesh, rules, weight_layout)
        self.layers = nnx.Dict(
            {name: self.layer_param(params[name], axes[name], name in LAYER_MATRICES) for name in layer_shapes(config)}
        )
        self.ple = nnx.Dict({name: self.param(params[name], axes[name]) for name in _ple_shapes(config)})

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, cache: Cache, logits_index=None, num_layers=None, packed=None
    ):
        """Logits ``[B, T, V]`` (float32), or ``[B, 1, V]`` at ``logits_index`` ``[B]``, and the
        updated cache. ``packed``: a serving step's ``jaxkv.batch.PackedBatch``. ``num_layers``: run
        only the first ``num_layers`` layers, then the final norm and head (an early-exit draft)."""
        config = self.config
        depth = check_num_layers(config, num_layers)
        embed = self.embed[...]
        x = embed[tokens] * jnp.asarray(math.sqrt(config.hidden_size), embed.dtype)
        x = self.constrain(x, Axes(BATCH, None, EMBED))
        per_layer_inputs = self._per_layer_inputs(tokens, x)
        layers_of = {name: layers for name, (_, _, layers) in _layer_params(config).items()}
        stacks = {name: (param[...], layers_of[name]) for name, param in self.layers.items()}
        # A prefill asking for some positions' logits runs the layers that reuse K/V (they write
        # nothing) on those positions only, as transformers does; a serving step's packed views
        # describe every packed token, so it runs them on all.
        narrowed_at = _first_reusing(config) if logits_index is not None and packed is None else None
        cache = cache.with_prefetch()
        for layer in range(depth):
            if layer == narrowed_at:
                x, positions, per_layer_inputs = _at_logits_positions(logits_index, x, positions, per_layer_inputs)
            w = {name: stack[layers.index(layer)] for name, (stack, layers) in stacks.items() if layer in layers}
            x, cache = self._layer(layer, x, w, positions, cache, per_layer_inputs, packed)
        logits = self.head(x, logits_index if narrowed_at is None or narrowed_at >= depth else None, rms_norm)
        if config.final_logit_softcapping is not None:
            cap = config.final_logit_softcapping
            logits = cap * jnp.tanh(logits / cap)
        return logits, cache.without_prefetch()

    def early_exit(
        self, tokens: jax.Array, positions: jax.Array, cache: Cache, num_layers: int
    ) -> tuple[jax.Array, Cache]:
        """Logits of the first ``num_layers`` layers and the updated cache: the draft of self-speculative decoding."""
        return self(tokens, positions, cache, num_layers=num_layers)

    def _per_layer_inputs(self, tokens: jax.Array, x: jax.Array) -> jax.Array | None:
        """``[B, T, L, P]``: each token's per-layer embedding mixed with a projection of its main
        embedding ``x`` ``[B, T, D]`` (transformers' ``project_per_layer_inputs``); None without PLE."""
        config = self.config
        width = config.hidden_size_per_layer_input
        if not width:
            return None
        table = self.ple["ple_embed"][...]
        shape = (*tokens.shape, config.num_hidden_layers, width)
        identity = (table[tokens] * jnp.asarray(math.sqrt(width), table.dtype)).reshape(shape)
        projected = (x @ self.ple["ple_model_proj"][...]) * jnp.asarray(config.hidden_size**-0.5, x.dtype)
        projected = rms_norm(projected.reshape(shape), self.ple["ple_proj_norm"][...], config.rms_norm_eps)
        return (projected + identity) * jnp.asarray(2.0**-0.5, x.dtype)

    def _layer(self, layer: int, x, w: dict, positions, cache: Cache, per_layer_inputs, packed):
        """Decoder layer ``layer`` on ``x`` ``[B, T, D]`` with its weights ``w``; returns ``x`` and the cache."""
        config, matmul, eps = self.config, self.matmul, self.config.rms_norm_eps
        kind = config.layer_types[layer]
        w = {name.removesuffix(KIND_SUFFIX[kind]).removesuffix("_wide"): value for name, value in w.items()}
        cache, out = self._attention(layer, rms_norm(x, w["attn_norm"], eps), w, positions, cache, packed)
        x = x + rms_norm(out, w["post_attn_norm"], eps)
        x = x + rms_norm(self._feed_forward(x, w), w["post_mlp_norm"], eps)
        if per_layer_inputs is not None:
            gate = jax.nn.gelu(matmul(x, w["ple_gate"]), approximate=True) * per_layer_inputs[:, :, layer]
            x = x + rms_norm(matmul(gate, w["ple_proj"]), w["ple_norm"], eps)
        return x * w["layer_scalar"].astype(x.dtype), cache

    def _attention(self, layer: int, h, w: dict, positions, cache: Cache, packed) -> tuple[Cache, jax.Array]:
        """Layer ``layer``'s attention of the normed ``h`` ``[B, T, D]`` (its weights ``w`` named without
        their type's suffix): the cache and the output projected back ``[B, T, D]``. A layer that
        reuses K/V projects queries only."""
        config, matmul, eps = self.config, self.matmul, self.config.rms_norm_eps
        kind = config.layer_types[layer]
        kv_heads, dim = config.kind_shape(kind)
        inv_freq = rope_frequencies(getattr(config.rope_parameters, kind), dim)
        batch, length, _ = h.shape
        heads = lambda t, n: t.reshape(batch, length, n, dim).transpose(0, 2, 1, 3)  # noqa: E731
        q = rms_norm(heads(matmul(h, w["wq"]), config.num_attention_heads), w["q_norm"], eps)
        q = apply_rope(q, positions, inv_freq)
        k = v = None
        if _stores(config, layer):
            projected = heads(matmul(h, w["wk"]), kv_heads)
            k = apply_rope(rms_norm(projected, w["k_norm"], eps), positions, inv_freq)
            if not _keys_as_values(config, kind):
                projected = heads(matmul(h, w["wv"]), kv_heads)
            v = rms_norm(projected, jnp.ones(dim, h.dtype), eps)  # scale-free
        cache, out = cached_attention(cache, layer, q, k, v, positions, scale=1.0, packed=packed)
        return cache, matmul(out.transpose(0, 2, 1, 3).reshape(batch, length, -1), w["wo"])

    def _feed_forward(self, x, w: dict) -> jax.Array:
        """The GeGLU MLP of the normed ``x`` ``[B, T, D]``, plus with ``enable_moe_block`` the
        mixture of experts (each output normed), before the post-feed-forward norm."""
        matmul, eps = self.matmul, self.config.rms_norm_eps
        h = rms_norm(x, w["mlp_norm"], eps)
        h = matmul(jax.nn.gelu(matmul(h, w["w_gate"]), approximate=True) * matmul(h, w["w_up"]), w["w_down"])
        if not self.config.enable_moe_block:
            return h
        return rms_norm(h, w["post_mlp_norm_1"], eps) + rms_norm(self._experts(x, w), w["post_moe_norm"], eps)

    def _experts(self, x, w: dict) -> jax.Array:
        """transformers' router and experts on the layer's residual stream ``x`` ``[B, T, D]``: the
        softmax's top ``top_k_experts`` renormalised and scaled per expert. A dense reference: every
        expert runs on every token and the others' weights are 0 (the cost of all experts)."""
        config, eps = self.config, self.config.rms_norm_eps
        routed = rms_norm(x, jnp.ones(x.shape[-1], x.dtype), eps) * w["router_scale"]
        routed = routed * jnp.asarray(config.hidden_size**-0.5, x.dtype)
        probabilities = jax.nn.softmax(self.matmul(routed, w["router"]).astype(jnp.float32), axis=-1)
        top, chosen = jax.lax.top_k(probabilities, config.top_k_experts)
        top = top / jnp.sum(top, axis=-1, keepdims=True) * w["expert_scale"][chosen]
        weights = jnp.sum(jax.nn.one_hot(chosen, config.num_experts) * top[..., None], axis=-2)  # [B, T, E]
        h = rms_norm(x, w["pre_moe_norm"], eps)
        gate, up = jnp.split(jnp.einsum("btd,eid->btei", h, w["moe_gate_up"]), 2, axis=-1)
        out = jnp.einsum("btei,edi->bted", jax.nn.gelu(gate, approximate=True) * up, w["moe_down"])
        return jnp.einsum("bte,bted->btd", weights.astype(x.dtype), out)
