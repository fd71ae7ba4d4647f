"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) in one readable file.

Follow one token: ``embed`` -> for each layer (scanned): RMSNorm -> q/k/v projections ->
RoPE -> ``cached_attention`` (the cache stores K/V, attention reads them) -> output projection -> residual -> RMSNorm ->
SwiGLU MLP -> residual; then the final RMSNorm and the LM head.

The layer weights are stacked along a leading layer axis and the layers run in one
``lax.scan``, so compile time does not grow with depth. The cache travels in the scan's
carry (``cached_attention(cache, i, ...)`` writes layer i's slice in place), never as ``xs``/``ys``,
which would rewrite the whole cache every step. Each matrix is kept as PyTorch stores it
(``[out, in]``, applied as ``x @ w.T``; ``Decoder.layer_param``): the layout in which XLA's
CPU backend reads a scanned layer's weights in place when one row decodes.

What every decoder here shares (RMSNorm, RoPE, the parameter checks, the embedding, final
norm and LM head around the layers, ``init_cache``) is in ``jaxkv.models.common``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PositiveInt, model_validator

from jaxkv.attention import cached_attention
from jaxkv.cache import Cache
from jaxkv.models.common import (
    Decoder, DecoderConfig, apply_rope, check_num_layers, checked_params, decoder_param_axes, decoder_param_shapes,
    inverse_frequencies, layer_weights, rms_norm,
)  # fmt: skip
from jaxkv.sharding import BATCH, EMBED, KV_HEADS, MLP, Q_HEADS, Axes


class RopeScaling(BaseModel):
    """``rope_scaling`` of a HF config; 'default', 'linear' and 'llama3' are supported."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # hashable: the config is static under jit
    rope_type: str = Field("default", validation_alias=AliasChoices("rope_type", "type"))
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class LlamaConfig(DecoderConfig):
    """The fields of a HF ``config.json`` this model reads (others are ignored)."""

    rms_norm_eps: float = 1e-5
    max_position_embeddings: PositiveInt = 2048
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False  # Qwen2 sets qkv_bias through its model type
    sliding_window: PositiveInt | None = None
    use_sliding_window: bool = True
    layer_types: tuple[str, ...] | None = None

    @model_validator(mode="before")
    @classmethod
    def from_hf_names(cls, data):
        """Accept what transformers writes: v5's ``rope_parameters``, Qwen2's implicit qkv
        bias; refuse variants this model does not implement instead of ignoring them."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        rope = data.pop("rope_parameters", None)
        if rope:
            data.setdefault("rope_theta", rope.get("rope_theta", 10_000.0))
            if rope.get("rope_type", "default") != "default":
                data.setdefault("rope_scaling", rope)
        if data.get("model_type") == "qwen2":
            data.setdefault("attention_bias", True)
        if data.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported by jaxkv.models.llama")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {data['hidden_act']!r} is not supported by jaxkv.models.llama (silu only)")
        return data


def rope_frequencies(config: LlamaConfig) -> jax.Array:
    """Inverse frequencies ``[D/2]``, with the config's RoPE scaling applied."""
    inv_freq = inverse_frequencies(config.rope_theta, config.dim_per_head)
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        return jnp.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), blended, scaled)
    raise ValueError(f"rope_scaling type {scaling.rope_type!r} is not supported; use default, linear or llama3")


# Per-layer weight names and shapes (without the leading layer axis); x @ w layout.
def layer_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    d, hd, ff = config.hidden_size, config.dim_per_head, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.kv_heads * hd
    shapes = {
        "attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
        "mlp_norm": (d,), "w_gate": (d, ff), "w_up": (d, ff), "w_down": (ff, d),
    }  # fmt: skip
    if config.attention_bias:
        shapes |= {"bq": (q,), "bk": (kv,), "bv": (kv,)}
    return shapes


def layer_axes(config: LlamaConfig) -> dict[str, Axes]:
    """The logical axes (``jaxkv.sharding``) of ``layer_shapes``' weights: heads and the MLP
    hidden dimension are what tensor parallelism splits."""
    axes = {
        "attn_norm": Axes(EMBED), "wq": Axes(EMBED, Q_HEADS), "wk": Axes(EMBED, KV_HEADS),
        "wv": Axes(EMBED, KV_HEADS), "wo": Axes(Q_HEADS, EMBED), "mlp_norm": Axes(EMBED),
        "w_gate": Axes(EMBED, MLP), "w_up": Axes(EMBED, MLP), "w_down": Axes(MLP, EMBED),
    }  # fmt: skip
    if config.attention_bias:
        axes |= {"bq": Axes(Q_HEADS), "bk": Axes(KV_HEADS), "bv": Axes(KV_HEADS)}
    return axes


LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape; per-layer ones carry a leading layer axis."""
    return decoder_param_shapes(config, layer_shapes(config))


def param_axes(config: LlamaConfig) -> dict[str, Axes]:
    """Every parameter's logical axes (``x @ w`` layout), as ``param_shapes`` names them."""
    return decoder_param_axes(config, layer_axes(config))


class Llama(Decoder):
    """``logits, cache = model(tokens [B, T], positions [B, T], cache)``; positions < 0 are padding."""

    def __init__(
        self, config: LlamaConfig, params: dict | None = None, *, dtype=jnp.float32, seed: int = 0, scan_layers=True,
        weight_layout: str = "out_in", mesh=None, rules=None,
    ):  # fmt: skip
        """``params``: arrays named as ``param_shapes`` gives (layer weights stacked on a
        leading layer axis, ``x @ w`` layout), e.g. from ``jaxkv.models.weights``; random if None.

        ``scan_layers``: run the layers in one ``lax.scan`` over the stacked weights, so
        compile time does not grow with depth. On CPU each scan step copies its layer's
        weight slice before the matmuls read it (XLA's CPU dot needs a whole buffer), which
        adds to the weight traffic of a memory-bound decode step (except for a one-row decode,
        which reads the "out_in" layout in place); ``False`` keeps one buffer per layer and
        unrolls the layers: compile time growing with depth.

        ``weight_layout``: ``"out_in"`` (default) stores each layer matrix ``[out, in]`` and
        applies it as ``x @ w.T``; ``"in_out"`` stores ``[in, out]`` (``x @ w``). See
        ``Decoder.layer_param`` for why "out_in" serves both batch 1 and batch 8.

        ``mesh``, ``rules``: shard the weights over ``mesh`` by their logical axes
        (``param_axes``; ``jaxkv.sharding``), and the caches ``init_cache`` builds with them."""
        params = checked_params("Llama", param_shapes(config), params, dtype=dtype, seed=seed, norm_value=1.0)
        axes = param_axes(config)
        super().__init__(config, params, axes, mesh, rules, weight_layout)

        def stored(name, array, axes):
            return self.layer_param(array, axes, name in LAYER_MATRICES)

        if scan_layers:
            self.layers = nnx.Dict({name: stored(name, params[name], axes[name]) for name in layer_shapes(config)})
        else:
            self.layers = nnx.List(
                nnx.Dict({name: stored(name, params[name][i], axes[name][1:]) for name in layer_shapes(config)})
                for i in range(config.num_hidden_layers)
            )

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, cache: Cache, logits_index=None, num_layers=None, packed=None
    ):
        """Logits ``[B, T, V]`` (float32), or ``[B, 1, V]`` at ``logits_index`` ``[B]``
        (a prefill needs only each row's last prompt token), and the updated cache.
        ``packed``: a serving step's ``jaxkv.batch.PackedBatch`` (``tokens`` ``[1, N]`` of many rows).

        ``num_layers``: run only the first ``num_layers`` layers, then the final norm and
        head: an early-exit draft for self-speculative decoding. Later layers' cache
        entries are left as they were."""
        config = self.config
        depth = check_num_layers(config, num_layers)
        batch, length = tokens.shape
        inv_freq = rope_frequencies(config)
        heads = lambda t, n: t.reshape(batch, length, n, config.dim_per_head).transpose(0, 2, 1, 3)  # noqa: E731
        matmul = self.matmul

        def decoder_layer(carry, w):
            x, cache, i = carry
            h = rms_norm(x, w["attn_norm"], config.rms_norm_eps)
            q, k, v = matmul(h, w["wq"]), matmul(h, w["wk"]), matmul(h, w["wv"])
            if config.attention_bias:
                q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
            q = apply_rope(heads(q, config.num_attention_heads), positions, inv_freq)
            k = apply_rope(heads(k, config.kv_heads), positions, inv_freq)
            cache, out = cached_attention(cache, i, q, k, heads(v, config.kv_heads), positions, packed=packed)
            x = x + matmul(out.transpose(0, 2, 1, 3).reshape(batch, length, -1), w["wo"])
            h = rms_norm(x, w["mlp_norm"], config.rms_norm_eps)
            x = x + matmul(jax.nn.silu(matmul(h, w["w_gate"])) * matmul(h, w["w_up"]), w["w_down"])
            return (x, cache, i + 1), None

        x = self.constrain(self.embed_tokens(tokens), Axes(BATCH, None, EMBED))
        cache = cache.with_prefetch()  # offloaded K/V: layer i + 1 comes to the device while layer i runs
        if isinstance(self.layers, nnx.List):
            for i, layer in enumerate(self.layers[:depth]):
                (x, cache, _), _ = decoder_layer((x, cache, i), {name: param[...] for name, param in layer.items()})
        else:
            stacks = {name: param[...] for name, param in self.layers.items()}

            def scanned_layer(carry, _):
                return decoder_layer(carry, layer_weights(stacks, carry[2]))

            (x, cache, _), _ = jax.lax.scan(scanned_layer, (x, cache, jnp.int32(0)), length=depth)
        return self.head(x, logits_index, rms_norm), cache.without_prefetch()

    def early_exit(
        self, tokens: jax.Array, positions: jax.Array, cache: Cache, num_layers: int
    ) -> tuple[jax.Array, Cache]:
        """Logits of the first ``num_layers`` layers and the updated cache: the draft of self-speculative decoding."""
        return self(tokens, positions, cache, num_layers=num_layers)
