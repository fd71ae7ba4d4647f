"""BART (encoder-decoder) in one readable file, built like ``jaxkv.models.llama``.

Why BART rather than T5: BART's attention is plain scaled dot-product attention with
learned absolute position embeddings, so its encoder self-attention, decoder
self-attention and cross-attention all run through ``jaxkv.attention`` unchanged and the
positions a cache hands out index the position table directly. T5 adds a learned
relative-position bias to every self-attention logit, which ``jaxkv.attention`` has no
input for; supporting it would change the core attention for one model.

Follow one input. Encoder (``encode``, once per input): ``embed * scale`` + learned
position -> LayerNorm -> for each layer (scanned): bidirectional self-attention over the
non-padding tokens -> residual -> LayerNorm -> MLP -> residual -> LayerNorm. Its output is
projected by every decoder layer's cross-attention K/V weights in one einsum and stored in
the ``EncoderDecoderCache``. Decoder (``__call__``, the prefill and every step): ``embed *
scale`` + learned position -> LayerNorm -> for each layer (scanned, cache in the carry):
causal self-attention through ``cache.update`` -> residual -> LayerNorm -> cross-attention
over ``cache.cross_attention(i)`` -> residual -> LayerNorm -> MLP -> residual -> LayerNorm;
then the tied LM head plus ``final_logits_bias``. Every sublayer is post-norm (BART, not
mBART's pre-norm).

Weights come from a transformers ``BartForConditionalGeneration`` state dict
(``params_from_state_dict``): ``[out, in]`` Linear weights are transposed to ``x @ w``
layout and per-layer tensors stacked on a leading layer axis.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator

from jaxkv.attention import attention
from jaxkv.cache import Cache
from jaxkv.encoder_decoder import EncoderDecoderCache, bidirectional_view
from jaxkv.models.common import at_logits_index, checked_params, output_logits

# BART's learned position table starts 2 rows in (rows 0 and 1 are a fairseq leftover).
POSITION_OFFSET = 2
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which BART uses

# transformers' ACT2FN names -> the function (exact erf GELU for "gelu", as torch).
ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}

SIDES = ("encoder", "decoder")


class BartConfig(BaseModel):
    """The fields of a HF ``BartConfig`` (``config.json``) this model reads."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # hashable: the config is static under jit
    vocab_size: PositiveInt
    d_model: PositiveInt
    encoder_layers: PositiveInt
    decoder_layers: PositiveInt
    encoder_attention_heads: PositiveInt
    decoder_attention_heads: PositiveInt
    encoder_ffn_dim: PositiveInt
    decoder_ffn_dim: PositiveInt
    activation_function: str = "gelu"
    max_position_embeddings: PositiveInt = 1024
    scale_embedding: bool = False
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int = 2

    @model_validator(mode="before")
    @classmethod
    def supported(cls, data):
        """Refuse BART variants this model does not implement instead of ignoring them."""
        if not isinstance(data, dict):
            return data
        if data.get("model_type", "bart") != "bart":
            raise ValueError(f"jaxkv.models.bart reads BART configs, got model_type {data['model_type']!r}")
        if not data.get("tie_word_embeddings", True):
            raise ValueError(
                "tie_word_embeddings=False (separate encoder, decoder and output embeddings) is not supported by "
                "jaxkv.models.bart; released BART checkpoints tie them"
            )
        activation = data.get("activation_function", "gelu")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation_function {activation!r} is not supported; known: {sorted(ACTIVATIONS)}")
        for side in SIDES:
            heads, width = data.get(f"{side}_attention_heads"), data.get("d_model")
            if heads and width and width % heads:
                raise ValueError(f"d_model {width} is not a multiple of {side}_attention_heads {heads}")
        return data

    def head_dim(self, side: str) -> int:
        return self.d_model // getattr(self, f"{side}_attention_heads")


def layer_norm(x: jax.Array, scale: jax.Array, shift: jax.Array) -> jax.Array:
    """LayerNorm of the last axis in float32, then ``* scale + shift``."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(variance + LAYER_NORM_EPS)
    return (normed * scale + shift).astype(x.dtype)


def _attention_shapes(block: str, d: int) -> dict[str, tuple[int, ...]]:
    """One attention block (``self`` or ``cross``): projections with biases, then its norm."""
    shapes = {}
    for proj in "qkvo":
        shapes |= {f"{block}_w{proj}": (d, d), f"{block}_b{proj}": (d,)}
    return shapes | {f"{block}_norm": (d,), f"{block}_norm_bias": (d,)}


# Per-layer weight names and shapes (without the leading layer axis); x @ w layout.
def layer_shapes(config: BartConfig, side: str) -> dict[str, tuple[int, ...]]:
    d, ff = config.d_model, getattr(config, f"{side}_ffn_dim")
    shapes = _attention_shapes("self", d)
    if side == "decoder":
        shapes |= _attention_shapes("cross", d)
    return shapes | {
        "fc1": (d, ff), "fc1_bias": (ff,), "fc2": (ff, d), "fc2_bias": (d,), "mlp_norm": (d,), "mlp_norm_bias": (d,),
    }  # fmt: skip


def param_shapes(config: BartConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape (the LM head is the token embedding); per-layer
    ones are ``"{side}.{name}"`` with a leading layer axis."""
    d = config.d_model
    shapes = {"embed": (config.vocab_size, d), "logits_bias": (config.vocab_size,)}
    for side in SIDES:
        shapes |= {
            f"{side}_position_embed": (config.max_position_embeddings + POSITION_OFFSET, d),
            f"{side}_embed_norm": (d,),
            f"{side}_embed_norm_bias": (d,),
        }
        num_layers = getattr(config, f"{side}_layers")
        shapes |= {f"{side}.{name}": (num_layers, *shape) for name, shape in layer_shapes(config, side).items()}
    return shapes


def hf_names(config: BartConfig) -> dict[str, str]:
    """Our parameter name -> transformers tensor name; ``{i}`` is the layer index."""
    names = {"embed": "model.shared.weight", "logits_bias": "final_logits_bias"}
    for side in SIDES:
        prefix = f"model.{side}"
        names |= {
            f"{side}_position_embed": f"{prefix}.embed_positions.weight",
            f"{side}_embed_norm": f"{prefix}.layernorm_embedding.weight",
            f"{side}_embed_norm_bias": f"{prefix}.layernorm_embedding.bias",
        }
        layer = f"{prefix}.layers.{{i}}"
        blocks = {"self": "self_attn", "cross": "encoder_attn"} if side == "decoder" else {"self": "self_attn"}
        for ours, theirs in blocks.items():
            for proj, module in zip("qkvo", ("q_proj", "k_proj", "v_proj", "out_proj")):
                names[f"{side}.{ours}_w{proj}"] = f"{layer}.{theirs}.{module}.weight"
                names[f"{side}.{ours}_b{proj}"] = f"{layer}.{theirs}.{module}.bias"
            names[f"{side}.{ours}_norm"] = f"{layer}.{theirs}_layer_norm.weight"
            names[f"{side}.{ours}_norm_bias"] = f"{layer}.{theirs}_layer_norm.bias"
        for ours, theirs in (("fc1", "fc1"), ("fc2", "fc2"), ("mlp_norm", "final_layer_norm")):
            names[f"{side}.{ours}"] = f"{layer}.{theirs}.weight"
            names[f"{side}.{ours}_bias"] = f"{layer}.{theirs}.bias"
    return names


def params_from_state_dict(config: BartConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32) -> dict:
    """Parameters named as ``param_shapes`` from a ``BartForConditionalGeneration`` state
    dict (tensor name -> array, torch layout). Missing or unexpected tensors are errors
    naming them; shapes are checked by the model."""
    names = hf_names(config)

    def sources(name: str) -> list[str]:  # one tensor per layer for a stacked parameter
        if "." not in name:
            return [names[name]]
        return [names[name].format(i=i) for i in range(getattr(config, f"{name.split('.')[0]}_layers"))]

    wanted = {name: sources(name) for name in param_shapes(config)}
    # The encoder and decoder token embeddings and the LM head are tied copies of model.shared (checked).
    copies = {"model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"}
    expected = {tensor for group in wanted.values() for tensor in group}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected - copies)
    if missing or unexpected:
        raise ValueError(f"BART state dict: missing tensor(s) {missing}, unexpected {unexpected}")
    for copy in sorted(copies & set(tensors)):
        if not np.array_equal(np.asarray(tensors[copy]), np.asarray(tensors[names["embed"]])):
            raise ValueError(
                f"BART state dict: {copy} differs from model.shared.weight; untied embeddings are not supported"
            )

    def read(name: str, tensor: str) -> np.ndarray:
        array = np.asarray(tensors[tensor])
        if name == "logits_bias":
            return array.reshape(-1)  # stored [1, V]
        return array.T if "." in name and array.ndim == 2 else array  # torch Linear [out, in] -> x @ w

    return {
        name: jnp.asarray(np.stack([read(name, t) for t in group]) if "." in name else read(name, group[0]), dtype)
        for name, group in wanted.items()
    }


def split_heads(x: jax.Array, weight: jax.Array, bias: jax.Array, num_heads: int) -> jax.Array:
    """Project ``x`` ``[B, T, d]`` and split heads: ``[B, H, T, d / H]``."""
    batch, length, _ = x.shape
    return (x @ weight + bias).reshape(batch, length, num_heads, -1).transpose(0, 2, 1, 3)


def merge_heads(out: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    """Merge heads ``[B, H, T, D]`` and project back: ``[B, T, d]``."""
    batch, _, length, _ = out.shape
    return out.transpose(0, 2, 1, 3).reshape(batch, length, -1) @ weight + bias


class Bart(nnx.Module):
    """``cache = model.encode(tokens, positions, cache)`` once per input, then
    ``logits, cache = model(tokens [B, T], positions [B, T], cache)`` for the decoder;
    positions < 0 are padding in both."""

    def __init__(self, config: BartConfig, params: dict | None = None, *, dtype=jnp.float32, seed: int = 0):
        """``params``: arrays named as ``param_shapes`` gives (e.g. ``params_from_state_dict``);
        random if None."""
        self.config = config
        params = checked_params("Bart", param_shapes(config), params, dtype=dtype, seed=seed, norm_value=1.0)
        # Everything outside the layer stacks: embeddings (the tied LM head too), their norms, the logits bias.
        self.embeddings = nnx.Dict({name: nnx.Param(jnp.asarray(p)) for name, p in params.items() if "." not in name})
        self.encoder_layers, self.decoder_layers = (
            nnx.Dict({name: nnx.Param(jnp.asarray(params[f"{side}.{name}"])) for name in layer_shapes(config, side)})
            for side in SIDES
        )

    def init_cache(
        self, batch_size: int, max_length: int | None = None, *, encoder_length: int, **cache_kwargs
    ) -> EncoderDecoderCache:
        """A cache for inputs of up to ``encoder_length`` tokens; ``cache_kwargs`` go to
        ``Cache.from_layer_types`` for the decoder's self-attention half."""
        config = self.config
        dtype = cache_kwargs.pop("dtype", self.embeddings["embed"][...].dtype)
        heads, head_dim = config.decoder_attention_heads, config.head_dim("decoder")
        self_attention = Cache.from_layer_types(
            ("full_attention",) * config.decoder_layers,
            batch_size=batch_size,
            num_kv_heads=heads,
            head_dim=head_dim,
            max_length=max_length,
            dtype=dtype,
            stacked=True,
            **cache_kwargs,
        )
        return EncoderDecoderCache.create(
            self_attention, encoder_length=encoder_length, num_kv_heads=heads, head_dim=head_dim, dtype=dtype
        )

    def embed(self, side: str, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """Token plus learned position embedding, normalized: ``[B, T, d]``."""
        outer = {name: p[...] for name, p in self.embeddings.items()}
        scale = math.sqrt(self.config.d_model) if self.config.scale_embedding else 1.0
        position_rows = jnp.maximum(positions, 0) + POSITION_OFFSET  # padding reads row 2; it is masked anyway
        x = outer["embed"][tokens] * scale + outer[f"{side}_position_embed"][position_rows]
        return layer_norm(x, outer[f"{side}_embed_norm"], outer[f"{side}_embed_norm_bias"])

    def mlp(self, x: jax.Array, w: dict) -> jax.Array:
        """Post-norm feed-forward sublayer, residual included."""
        hidden = ACTIVATIONS[self.config.activation_function](x @ w["fc1"] + w["fc1_bias"])
        return layer_norm(x + hidden @ w["fc2"] + w["fc2_bias"], w["mlp_norm"], w["mlp_norm_bias"])

    def encoder_output(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """The encoder's last hidden state ``[B, S, d]`` for ``tokens`` ``[B, S]``."""
        heads = self.config.encoder_attention_heads

        def encoder_layer(x, w):
            q, k, v = (split_heads(x, w[f"self_w{p}"], w[f"self_b{p}"], heads) for p in "qkv")
            out = attention(q, bidirectional_view(k[None], v[None], 0, positions), positions)
            x = layer_norm(x + merge_heads(out, w["self_wo"], w["self_bo"]), w["self_norm"], w["self_norm_bias"])
            return self.mlp(x, w), None

        weights = {name: p[...] for name, p in self.encoder_layers.items()}
        x, _ = jax.lax.scan(encoder_layer, self.embed("encoder", tokens, positions), weights)
        return x

    def encode(self, tokens: jax.Array, positions: jax.Array, cache: EncoderDecoderCache) -> EncoderDecoderCache:
        """Run the encoder on ``tokens`` ``[B, S]`` (right-padded, padding at negative
        ``positions``) and store every decoder layer's cross-attention K/V in ``cache``."""
        out = self.encoder_output(tokens, positions)
        heads = self.config.decoder_attention_heads
        w = {name: self.decoder_layers[name][...] for name in ("cross_wk", "cross_bk", "cross_wv", "cross_bv")}

        def project(weight, bias):  # all decoder layers at once: [L, B, H, S, D]
            kv = jnp.einsum("bsd,lde->lbse", out, weight) + bias[:, None, None, :]
            num_layers, batch, length, _ = kv.shape
            return kv.reshape(num_layers, batch, length, heads, -1).transpose(0, 1, 3, 2, 4)

        keys, values = project(w["cross_wk"], w["cross_bk"]), project(w["cross_wv"], w["cross_bv"])
        return cache.with_cross_attention(keys, values, positions)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: EncoderDecoderCache, logits_index=None):
        """Decoder logits ``[B, T, V]`` (float32), or ``[B, 1, V]`` at ``logits_index``
        ``[B]``, and the updated cache. ``encode`` must have filled the cache's cross half."""
        heads = self.config.decoder_attention_heads

        def decoder_layer(carry, w):
            x, cache, i = carry
            q, k, v = (split_heads(x, w[f"self_w{p}"], w[f"self_b{p}"], heads) for p in "qkv")
            cache, kv = cache.update(i, k, v, positions)
            out = attention(q, kv, positions)
            x = layer_norm(x + merge_heads(out, w["self_wo"], w["self_bo"]), w["self_norm"], w["self_norm_bias"])
            q = split_heads(x, w["cross_wq"], w["cross_bq"], heads)
            out = attention(q, cache.cross_attention(i), positions)
            x = layer_norm(x + merge_heads(out, w["cross_wo"], w["cross_bo"]), w["cross_norm"], w["cross_norm_bias"])
            return (self.mlp(x, w), cache, i + 1), None

        weights = {name: p[...] for name, p in self.decoder_layers.items()}
        x = self.embed("decoder", tokens, positions)
        (x, cache, _), _ = jax.lax.scan(decoder_layer, (x, cache, jnp.int32(0)), weights)
        outer = {name: p[...] for name, p in self.embeddings.items()}
        logits = output_logits(at_logits_index(x, logits_index), outer["embed"])
        return logits + outer["logits_bias"].astype(jnp.float32), cache
