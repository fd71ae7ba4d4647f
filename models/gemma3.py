"""Gemma 3 text decoder (e.g. Gemma 3 270M) in one readable file, built like ``jaxkv.models.llama``
on the pieces of ``jaxkv.models.common``.

Follow one token: ``embed * sqrt(hidden)`` -> for each layer: RMSNorm -> q/k/v projections
-> per-head q/k RMSNorm -> RoPE (local base on sliding layers, global base on full ones) ->
``cached_attention`` (scale ``query_pre_attn_scalar ** -0.5``) -> output projection
-> RMSNorm -> residual -> RMSNorm -> GeGLU MLP (gelu tanh) -> RMSNorm -> residual; then the
final RMSNorm, the tied LM head and an optional logit soft-cap.

Layers follow a repeating pattern (270M: 5 sliding, 1 full). The cache stores layer i in
group ``i % period`` at index ``i // period``, so the model scans over repeats of the
pattern with the pattern itself unrolled in the scan body: each layer's kind (window, RoPE
base) is static, and compile time does not grow with depth. The layers after the last full
repeat (e.g. 7 layers with a pattern of 6) run unrolled after the scan.

``attn_logit_softcapping`` is read but not applied: Gemma 3 replaced Gemma 2's attention
soft-capping with the q/k norms, and transformers' Gemma 3 ignores the field too (the
reference this model must match). ``final_logit_softcapping`` is applied when set.

Norm weights are kept as transformers stores them (``w``; the norm multiplies by ``1 + w``,
in float32); the GGUF loader converts llama.cpp's stored ``1 + w`` back.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator

from jaxkv.attention import cached_attention
from jaxkv.cache import Cache
from jaxkv.models.common import (
    Decoder, DecoderConfig, apply_rope, check_num_layers, checked_params, decoder_param_axes, decoder_param_shapes,
    inverse_frequencies, layer_weights, offset_rms_norm,
)  # fmt: skip
from jaxkv.sharding import BATCH, EMBED, HEAD_DIM, KV_HEADS, MLP, Q_HEADS, Axes

SLIDING, FULL = "sliding_attention", "full_attention"


class RopeParameters(BaseModel):
    """RoPE of one layer type: 'default', or 'linear' (positions divided by ``factor``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # hashable: the config is static under jit
    rope_type: str = "default"
    rope_theta: float = 10_000.0
    factor: float = 1.0

    @model_validator(mode="after")
    def supported(self):
        if self.rope_type not in ("default", "linear"):
            raise ValueError(f"Gemma 3 rope_type {self.rope_type!r} is not supported; use default or linear")
        return self


class LayerRope(BaseModel):
    """transformers v5's per-layer-type ``rope_parameters`` of a Gemma 3 config."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    sliding_attention: RopeParameters = RopeParameters(rope_theta=10_000.0)
    full_attention: RopeParameters = RopeParameters(rope_theta=1_000_000.0)


class Gemma3Config(DecoderConfig):
    """The fields of a HF ``Gemma3TextConfig`` (``config.json``) this model reads."""

    num_key_value_heads: PositiveInt  # required, and the defaults below, as Gemma3TextConfig writes them
    head_dim: PositiveInt = 256
    tie_word_embeddings: bool = True
    max_position_embeddings: PositiveInt = 131_072
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    rope_parameters: LayerRope = LayerRope()
    sliding_window: PositiveInt = 4096
    layer_types: tuple[str, ...]
    query_pre_attn_scalar: float = 256
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # not applied (see the module docstring)

    @model_validator(mode="before")
    @classmethod
    def from_hf_names(cls, data):
        """Accept v5's ``rope_parameters`` and older (v4) configs' ``rope_theta`` /
        ``rope_local_base_freq`` / ``rope_scaling`` / ``sliding_window_pattern``; refuse
        variants this model does not implement instead of ignoring them."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        rope = data.get("rope_parameters")
        if rope is None or "rope_theta" in rope:  # v4 names, or one flat dict for the full layers
            full = dict(rope or data.get("rope_scaling") or {})
            full.setdefault("rope_theta", data.get("rope_theta", 1_000_000.0))
            local = {"rope_theta": data.get("rope_local_base_freq", 10_000.0)}
            data["rope_parameters"] = {SLIDING: local, FULL: full}
        if data.get("layer_types") is None:
            # Every `pattern`-th layer is global (Gemma 3: 6, i.e. 5 sliding : 1 full).
            pattern = data.get("sliding_window_pattern", data.get("_sliding_window_pattern", 6))
            data["layer_types"] = [
                FULL if (i + 1) % pattern == 0 else SLIDING for i in range(data["num_hidden_layers"])
            ]
        unknown = set(data["layer_types"]) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"Gemma 3 layer types {sorted(unknown)} are not supported (sliding/full attention only)")
        if len(data["layer_types"]) != data["num_hidden_layers"]:
            raise ValueError(f"{len(data['layer_types'])} layer_types for {data['num_hidden_layers']} layers")
        activation = data.get("hidden_activation") or data.get("hidden_act") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {activation!r} is not supported by jaxkv.models.gemma3 (gelu tanh only)"
            )
        if data.get("attention_bias"):
            raise ValueError("attention_bias=True is not supported by jaxkv.models.gemma3")
        if data.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True is not supported by jaxkv.models.gemma3 (causal only)")
        return data


def rope_frequencies(rope: RopeParameters, head_dim: int) -> jax.Array:
    """Inverse frequencies ``[D/2]`` of one layer type."""
    inv_freq = inverse_frequencies(rope.rope_theta, head_dim)
    return inv_freq / rope.factor if rope.rope_type == "linear" else inv_freq


def layer_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Per-layer weight names and shapes (without the leading layer axis); ``x @ w`` layout."""
    d, hd, ff = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return {
        "attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "q_norm": (hd,), "k_norm": (hd,),
        "wo": (q, d), "post_attn_norm": (d,),
        "mlp_norm": (d,), "w_gate": (d, ff), "w_up": (d, ff), "w_down": (ff, d), "post_mlp_norm": (d,),
    }  # fmt: skip


def param_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape; per-layer ones carry a leading layer axis."""
    return decoder_param_shapes(config, layer_shapes(config))


# The logical axes (jaxkv.sharding) of layer_shapes' weights: tensor parallelism splits heads and the MLP.
LAYER_AXES = {
    "attn_norm": Axes(EMBED), "wq": Axes(EMBED, Q_HEADS), "wk": Axes(EMBED, KV_HEADS), "wv": Axes(EMBED, KV_HEADS),
    "q_norm": Axes(HEAD_DIM), "k_norm": Axes(HEAD_DIM), "wo": Axes(Q_HEADS, EMBED), "post_attn_norm": Axes(EMBED),
    "mlp_norm": Axes(EMBED), "w_gate": Axes(EMBED, MLP), "w_up": Axes(EMBED, MLP), "w_down": Axes(MLP, EMBED),
    "post_mlp_norm": Axes(EMBED),
}  # fmt: skip


LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def param_axes(config: Gemma3Config) -> dict[str, Axes]:
    """Every parameter's logical axes, as ``param_shapes`` names them."""
    return decoder_param_axes(config, LAYER_AXES)


class Gemma3(Decoder):
    """``logits, cache = model(tokens [B, T], positions [B, T], cache)``; positions < 0 are padding."""

    def __init__(
        self, config: Gemma3Config, params: dict | None = None, *, dtype=jnp.float32, seed: int = 0, mesh=None,
        rules=None, weight_layout: str = "out_in",
    ):  # fmt: skip
        """``params``: arrays named as ``param_shapes`` gives (layer weights stacked on a
        leading layer axis, ``x @ w`` layout, norms as ``w`` of ``1 + w``); random if None.
        ``mesh``, ``rules``: shard the weights (and the caches of ``init_cache``) over ``mesh``.
        ``weight_layout``: matrices stored ``[out, in]`` (default) or ``[in, out]``; see
        ``Decoder.layer_param``."""
        params = checked_params("Gemma3", param_shapes(config), params, dtype=dtype, seed=seed, norm_value=0.0)
        axes = param_axes(config)
        super().__init__(config, params, axes, mesh, rules, weight_layout)
        self.layers = nnx.Dict(
            {name: self.layer_param(params[name], axes[name], name in LAYER_MATRICES) for name in layer_shapes(config)}
        )

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, cache: Cache, logits_index=None, num_layers=None, packed=None
    ):
        """Logits ``[B, T, V]`` (float32), or ``[B, 1, V]`` at ``logits_index`` ``[B]``
        (a prefill needs only each row's last prompt token), and the updated cache.
        ``packed``: a serving step's ``jaxkv.batch.PackedBatch`` (``tokens`` ``[1, N]`` of many rows).

        ``num_layers``: run only the first ``num_layers`` layers, then the final norm and
        head (an early-exit draft for self-speculative decoding); later layers' cache
        entries are left as they were."""
        config = self.config
        depth = check_num_layers(config, num_layers)
        batch, length = tokens.shape
        eps = config.rms_norm_eps
        inv_freq = {
            kind: rope_frequencies(getattr(config.rope_parameters, kind), config.head_dim) for kind in (SLIDING, FULL)
        }
        scale = config.query_pre_attn_scalar**-0.5
        heads = lambda t, n: t.reshape(batch, length, n, config.head_dim).transpose(0, 2, 1, 3)  # noqa: E731
        matmul = self.matmul

        def decoder_layer(x, cache, w, group, index):
            """Layer ``index * period + group``: ``group`` static (its kind), ``index`` may be traced."""
            kind = config.layer_types[group]
            h = offset_rms_norm(x, w["attn_norm"], eps)
            q = offset_rms_norm(heads(matmul(h, w["wq"]), config.num_attention_heads), w["q_norm"], eps)
            k = offset_rms_norm(heads(matmul(h, w["wk"]), config.num_key_value_heads), w["k_norm"], eps)
            q, k = apply_rope(q, positions, inv_freq[kind]), apply_rope(k, positions, inv_freq[kind])
            v = heads(matmul(h, w["wv"]), config.num_key_value_heads)
            cache, out = cached_attention(cache, (group, index), q, k, v, positions, scale=scale, packed=packed)
            out = matmul(out.transpose(0, 2, 1, 3).reshape(batch, length, -1), w["wo"])
            x = x + offset_rms_norm(out, w["post_attn_norm"], eps)
            h = offset_rms_norm(x, w["mlp_norm"], eps)
            h = matmul(jax.nn.gelu(matmul(h, w["w_gate"]), approximate=True) * matmul(h, w["w_up"]), w["w_down"])
            return x + offset_rms_norm(h, w["post_mlp_norm"], eps), cache

        # Embeddings are scaled by sqrt(hidden) rounded to the weights' dtype, as transformers does.
        x = self.embed_tokens(tokens)
        x = x * jnp.asarray(math.sqrt(config.hidden_size), x.dtype)
        x = self.constrain(x, Axes(BATCH, None, EMBED))

        period = cache.period
        repeats, remainder = divmod(depth, period)
        stacks = {name: param[...] for name, param in self.layers.items()}

        def pattern_repeat(carry, _):  # scan step r runs layers r * period + g, g < period
            x, cache, r = carry
            for group in range(period):
                x, cache = decoder_layer(x, cache, layer_weights(stacks, r * period + group), group, r)
            return (x, cache, r + 1), None

        cache = cache.with_prefetch()  # offloaded K/V: layer i + 1 comes to the device while layer i runs
        (x, cache, _), _ = jax.lax.scan(pattern_repeat, (x, cache, jnp.int32(0)), length=repeats)
        for group in range(remainder):  # layers repeats * period + group, after the last full repeat
            layer = repeats * period + group
            x, cache = decoder_layer(x, cache, layer_weights(stacks, layer), group, repeats)
        cache = cache.without_prefetch()

        logits = self.head(x, logits_index, offset_rms_norm)
        if config.final_logit_softcapping is not None:
            cap = config.final_logit_softcapping
            logits = cap * jnp.tanh(logits / cap)
        return logits, cache

    def early_exit(
        self, tokens: jax.Array, positions: jax.Array, cache: Cache, num_layers: int
    ) -> tuple[jax.Array, Cache]:
        """Logits of the first ``num_layers`` layers and the updated cache: the draft of self-speculative decoding."""
        return self(tokens, positions, cache, num_layers=num_layers)
