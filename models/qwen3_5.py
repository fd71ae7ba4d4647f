"""Qwen3.5 text decoder: gated DeltaNet (linear attention) layers mixed with gated full attention.

Why this hybrid: its config declares ``layer_types`` with exactly the container's
``linear_attention`` / ``full_attention`` (3 : 1), every layer has a dense SwiGLU MLP (no
experts, unlike Qwen3-Next or Jamba), and transformers' PyTorch path runs on CPU with no
extra kernels (its conv and delta-rule fallbacks are plain torch), so it is a clean
oracle. Falcon-H1 and Bamba (Mamba-2) run attention and SSM in parallel in one layer, with
extra multipliers; Qwen3.5 keeps each layer one kind.

Follow one token: ``embed`` -> per layer: RMSNorm (``1 + w``) -> token mixer -> residual ->
RMSNorm -> SwiGLU MLP -> residual; then the final RMSNorm and the LM head. The mixer is

* linear attention (gated DeltaNet): ``in_qkv`` projects to the conv inputs (q, k, v of
  the linear heads); ``cache.update_state`` runs the short causal conv over them (the cache
  keeps its last K - 1 inputs) and the delta rule over the tokens (the cache keeps the
  ``[H_v, D_k, D_v]`` state): per token, ``S <- exp(g) S``, then ``S <- S + k (beta (v - S^T k))^T``
  and the output ``S^T q``, with q, k L2-normalised and q scaled by ``D_k ** -0.5``; then a
  gated RMSNorm (``norm(o) * silu(z)``) and ``out``;
* full attention: q (with a sigmoid output gate from the same projection), k, v; RMSNorm
  of q and k per head; RoPE on the first quarter of each head (``partial_rotary_factor``);
  ``cached_attention`` -> gate -> ``wo``.

Text-only positions are equal in all three M-RoPE sections, so the sectioned RoPE of the
reference reduces to the plain (partial) RoPE used here. The delta rule runs token by
token in float32 (the cache's scan), which is the reference's decode form; its chunked
prefill form is a faster evaluation of the same recurrence.

Weights: the layers of the repeating pattern run in one ``lax.scan`` over its repeats
(as in ``jaxkv.models.gemma3``); MLP and norm weights are stacked over all layers, mixer weights
over the layers of their kind. Norms, RoPE, the head and ``init_cache`` come from ``jaxkv.models.common``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import PositiveInt, model_validator

from jaxkv.attention import cached_attention
from jaxkv.cache import Cache
from jaxkv.models.common import (
    Decoder, DecoderConfig, apply_rope, checked_params, decoder_param_axes, decoder_param_shapes, inverse_frequencies,
    offset_rms_norm, rms_norm,
)  # fmt: skip
from jaxkv.sharding import BATCH, EMBED, HEAD_DIM, KV_HEADS, LINEAR_PROJ, MLP, Q_HEADS, STATE, Axes

LINEAR, FULL = "linear_attention", "full_attention"
Layer = tuple[int, int | jax.Array]  # (group, index): layer index * period + group of the cache


class Qwen3_5Config(DecoderConfig):
    """The fields of a Qwen3.5 text ``config.json`` (``qwen3_5_text``) this model reads."""

    num_key_value_heads: PositiveInt  # required, as Qwen3_5TextConfig writes them
    head_dim: PositiveInt
    max_position_embeddings: PositiveInt = 32768
    linear_conv_kernel_dim: PositiveInt = 4
    linear_key_head_dim: PositiveInt
    linear_value_head_dim: PositiveInt
    linear_num_key_heads: PositiveInt
    linear_num_value_heads: PositiveInt
    layer_types: tuple[str, ...]
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25

    @model_validator(mode="before")
    @classmethod
    def from_hf_names(cls, data):
        """Read v5's ``rope_parameters``; refuse what this model does not implement."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        rope = data.pop("rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported by jaxkv.models.qwen3_5 (default only)")
        data.setdefault("rope_theta", rope.get("rope_theta", 10_000.0))
        data.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        for flag in ("attention_bias",):
            if data.get(flag):
                raise ValueError(f"{flag}=True is not supported by jaxkv.models.qwen3_5")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {data['hidden_act']!r} is not supported by jaxkv.models.qwen3_5 (silu only)")
        unknown = set(data.get("layer_types") or ()) - {LINEAR, FULL}
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not Qwen3.5's ({LINEAR!r}, {FULL!r})")
        return data

    @property
    def conv_channels(self) -> int:
        """The conv runs over q, k (linear key heads) and v (linear value heads)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_value_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


# Per-layer weight names and shapes (no layer axis), x @ w layout, by the layers they serve.
def shared_shapes(config: Qwen3_5Config) -> dict[str, tuple[int, ...]]:
    d, ff = config.hidden_size, config.intermediate_size
    return {"attn_norm": (d,), "mlp_norm": (d,), "w_gate": (d, ff), "w_up": (d, ff), "w_down": (ff, d)}


def full_shapes(config: Qwen3_5Config) -> dict[str, tuple[int, ...]]:
    d, hd = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return {"wq": (d, 2 * q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "q_norm": (hd,), "k_norm": (hd,)}


def linear_shapes(config: Qwen3_5Config) -> dict[str, tuple[int, ...]]:
    d, heads = config.hidden_size, config.linear_num_value_heads
    return {
        "in_qkv": (d, config.conv_channels), "in_z": (d, config.linear_value_dim), "in_b": (d, heads),
        "in_a": (d, heads), "conv": (config.conv_channels, 1, config.linear_conv_kernel_dim), "dt_bias": (heads,),
        "A_log": (heads,), "gated_norm": (config.linear_value_head_dim,), "out": (config.linear_value_dim, d),
    }  # fmt: skip


def layer_shapes(config: Qwen3_5Config) -> dict[str, tuple[int, ...]]:
    return shared_shapes(config) | full_shapes(config) | linear_shapes(config)


def param_layers(config: Qwen3_5Config, name: str) -> list[int]:
    """The layers whose weights a stacked parameter holds, in stacking order."""
    if name in shared_shapes(config):
        return list(range(config.num_hidden_layers))
    kind = FULL if name in full_shapes(config) else LINEAR
    return [i for i, t in enumerate(config.layer_types) if t == kind]


# The logical axes (jaxkv.sharding) of layer_shapes' weights. Tensor parallelism splits the
# attention heads and the MLP; the gated-DeltaNet projections are named ``linear_proj`` (replicated
# by the default rules: their conv mixes q, k and v channels across heads).
LAYER_AXES = {
    "attn_norm": Axes(EMBED), "mlp_norm": Axes(EMBED), "w_gate": Axes(EMBED, MLP), "w_up": Axes(EMBED, MLP),
    "w_down": Axes(MLP, EMBED), "wq": Axes(EMBED, Q_HEADS), "wk": Axes(EMBED, KV_HEADS),
    "wv": Axes(EMBED, KV_HEADS), "wo": Axes(Q_HEADS, EMBED), "q_norm": Axes(HEAD_DIM), "k_norm": Axes(HEAD_DIM),
    "in_qkv": Axes(EMBED, LINEAR_PROJ), "in_z": Axes(EMBED, LINEAR_PROJ), "in_b": Axes(EMBED, LINEAR_PROJ),
    "in_a": Axes(EMBED, LINEAR_PROJ), "conv": Axes(LINEAR_PROJ, None, STATE), "dt_bias": Axes(LINEAR_PROJ),
    "A_log": Axes(LINEAR_PROJ), "gated_norm": Axes(HEAD_DIM), "out": Axes(LINEAR_PROJ, EMBED),
}  # fmt: skip


def param_axes(config: Qwen3_5Config) -> dict[str, Axes]:
    """Every parameter's logical axes, as ``param_shapes`` names them."""
    return decoder_param_axes(config, LAYER_AXES)


def param_shapes(config: Qwen3_5Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape; per-layer ones carry a leading axis over ``param_layers``."""
    per_layer = layer_shapes(config)
    return decoder_param_shapes(config, per_layer, {name: len(param_layers(config, name)) for name in per_layer})


def layer_weights(config: Qwen3_5Config, weights: dict, period: int, group: int, index) -> dict[str, jax.Array]:
    """Weights of layer ``index * period + group`` (``index`` may be traced): shared ones are
    stacked over all layers, mixer ones over the layers of its kind (``param_layers``)."""
    pattern = config.layer_types[:period]
    kind = pattern[group]
    shared = {name: weights[name][index * period + group] for name in shared_shapes(config)}
    per_repeat, before = pattern.count(kind), pattern[:group].count(kind)
    mixer = linear_shapes(config) if kind == LINEAR else full_shapes(config)
    return shared | {name: weights[name][index * per_repeat + before] for name in mixer}


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_rule_step(states, x):
    """One token of the gated delta rule for all rows: ``S`` ``[B, H, D_k, D_v]``; q, k
    ``[B, H, D_k]``, v ``[B, H, D_v]``, log-decay g and write strength beta ``[B, H]``."""
    (state,) = states
    q, k, v, g, beta = x
    state = state * jnp.exp(g)[..., None, None]
    delta = (v - jnp.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return (state,), jnp.einsum("bhkv,bhk->bhv", state, q)


def partial_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, rotary_dim: int) -> jax.Array:
    """RoPE on the first ``rotary_dim`` dims of each head of ``x`` ``[B, H, T, D]``; the rest passes through."""
    return jnp.concatenate([apply_rope(x[..., :rotary_dim], positions, inv_freq), x[..., rotary_dim:]], axis=-1)


class Qwen3_5(Decoder):
    """``logits, cache = model(tokens [B, T], positions [B, T], cache)``; positions < 0 are padding."""

    def __init__(
        self, config: Qwen3_5Config, params: dict | None = None, *, dtype=jnp.float32, seed: int = 0, mesh=None,
        rules=None,
    ):  # fmt: skip
        """``params``: arrays named as ``param_shapes`` gives (``x @ w`` layout, ``1 + w``
        norms except the gated norm, which multiplies by w), e.g. from ``jaxkv.models.weights``;
        random if None. ``mesh``, ``rules``: shard the weights (and the caches of ``init_cache``)."""
        random = params is None
        params = checked_params("Qwen3_5", param_shapes(config), params, dtype=dtype, seed=seed, norm_value=0.0)
        if random:  # the gated norm multiplies by w, not 1 + w: start it at 1
            params["gated_norm"] = jnp.ones_like(params["gated_norm"])
        axes = param_axes(config)
        # Its matrices stay [in, out] (x @ w): the [out, in] layout of Decoder.layer_param is not applied here yet.
        super().__init__(config, params, axes, mesh, rules, weight_layout="in_out")
        self.layers = nnx.Dict({name: self.param(params[name], axes[name]) for name in layer_shapes(config)})

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Cache, logits_index=None, packed=None):
        """Logits ``[B, T, V]`` (float32), or ``[B, 1, V]`` at ``logits_index`` ``[B]``, and the cache.
        ``packed``: a serving step's ``jaxkv.batch.PackedBatch`` (``tokens`` ``[1, N]`` of many rows).

        The layers of the pattern run unrolled in the body of a scan over its repeats (the
        cache in the carry), then the layers after the last full repeat."""
        config = self.config
        inv_freq = inverse_frequencies(config.rope_theta, config.rotary_dim)
        period = cache.period
        repeats, remainder = divmod(config.num_hidden_layers, period)
        weights = {name: param[...] for name, param in self.layers.items()}

        def layer(x, cache, group, index):  # layer index * period + group; group static, index may be traced
            w = layer_weights(config, weights, period, group, index)
            return self.decoder_layer(x, w, cache, (group, index), positions, inv_freq, packed)

        def pattern_repeat(carry, _):
            x, cache, r = carry
            for group in range(period):
                x, cache = layer(x, cache, group, r)
            return (x, cache, r + 1), None

        x = self.constrain(self.embed[...][tokens], Axes(BATCH, None, EMBED))
        cache = cache.with_prefetch()  # offloaded K/V: layer i + 1 comes to the device while layer i runs
        (x, cache, _), _ = jax.lax.scan(pattern_repeat, (x, cache, jnp.int32(0)), length=repeats)
        for group in range(remainder):  # layers after the last full repeat
            x, cache = layer(x, cache, group, repeats)
        return self.head(x, logits_index, offset_rms_norm), cache.without_prefetch()

    def decoder_layer(
        self, x: jax.Array, w: dict, cache: Cache, layer: Layer, positions: jax.Array, inv_freq: jax.Array, packed=None
    ) -> tuple[jax.Array, Cache]:
        """One layer on ``x`` ``[B, T, D]``: RMSNorm -> its token mixer (by the kind of
        ``layer``'s group) -> residual -> RMSNorm -> SwiGLU MLP -> residual."""
        eps = self.config.rms_norm_eps
        h = offset_rms_norm(x, w["attn_norm"], eps)
        if self.config.layer_types[layer[0]] == LINEAR:
            out, cache = self.linear_attention(h, w, cache, layer, positions, packed)
        else:
            out, cache = self.full_attention(h, w, cache, layer, positions, inv_freq, packed)
        x = x + out
        h = offset_rms_norm(x, w["mlp_norm"], eps)
        return x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"], cache

    def full_attention(
        self, h: jax.Array, w: dict, cache: Cache, layer: Layer, positions: jax.Array, inv_freq: jax.Array, packed=None
    ) -> tuple[jax.Array, Cache]:
        """Gated full attention of ``h`` ``[B, T, D]``: q with its sigmoid output gate, k, v;
        RMSNorm of q and k per head; partial RoPE; ``cached_attention``; gate; ``wo``."""
        config = self.config
        batch, length, _ = h.shape
        hd, heads, eps = config.head_dim, config.num_attention_heads, config.rms_norm_eps
        q_and_gate = (h @ w["wq"]).reshape(batch, length, heads, 2 * hd)
        q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:].reshape(batch, length, heads * hd)
        q = offset_rms_norm(q, w["q_norm"], eps).transpose(0, 2, 1, 3)
        k = offset_rms_norm((h @ w["wk"]).reshape(batch, length, -1, hd), w["k_norm"], eps).transpose(0, 2, 1, 3)
        v = (h @ w["wv"]).reshape(batch, length, -1, hd).transpose(0, 2, 1, 3)
        q, k = (partial_rope(x, positions, inv_freq, config.rotary_dim) for x in (q, k))
        cache, out = cached_attention(cache, layer, q, k, v, positions, packed=packed)
        out = out.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        return (out * jax.nn.sigmoid(gate)) @ w["wo"], cache

    def linear_attention(
        self, h: jax.Array, w: dict, cache: Cache, layer: Layer, positions: jax.Array, packed=None
    ) -> tuple[jax.Array, Cache]:
        """Gated DeltaNet of ``h`` ``[B, T, D]`` (the module docstring's first bullet): the
        cache runs the conv and the delta rule; then the gated RMSNorm and ``out``."""
        config = self.config
        batch, length, _ = h.shape
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        beta = jax.nn.sigmoid((h @ w["in_b"]).astype(jnp.float32))
        g = -jnp.exp(w["A_log"].astype(jnp.float32)) * jax.nn.softplus(
            (h @ w["in_a"]).astype(jnp.float32) + w["dt_bias"]
        )

        def conv_fn(windows):  # [B, T, C, K] -> the delta rule's per-token inputs
            mixed = jax.nn.silu(jnp.einsum("btck,ck->btc", windows, w["conv"][:, 0]).astype(jnp.float32))
            q, k, v = jnp.split(mixed, [k_heads * dk, 2 * k_heads * dk], axis=-1)
            # Each q/k head serves v_heads // k_heads consecutive value heads.
            q, k = (
                jnp.repeat(l2_normalize(x.reshape(batch, length, k_heads, dk)), v_heads // k_heads, axis=2)
                for x in (q, k)
            )
            return q * dk**-0.5, k, v.reshape(batch, length, v_heads, dv), g, beta

        cache, out = cache.update_state(layer, h @ w["in_qkv"], positions, conv_fn, delta_rule_step, packed)
        z = (h @ w["in_z"]).reshape(batch, length, v_heads, dv)
        out = rms_norm(out, w["gated_norm"], config.rms_norm_eps) * jax.nn.silu(z.astype(jnp.float32))
        return out.reshape(batch, length, -1).astype(h.dtype) @ w["out"], cache
