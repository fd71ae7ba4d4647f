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
  ``cache.update`` -> attention -> gate -> ``wo``.

Text-only positions are equal in all three M-RoPE sections, so the sectioned RoPE of the
reference reduces to the plain (partial) RoPE used here. The delta rule runs token by
token in float32 (the cache's scan), which is the reference's decode form; its chunked
prefill form is a faster evaluation of the same recurrence.

Weights: the layers of the repeating pattern run in one ``lax.scan`` over its repeats
(as in ``jaxkv.models.gemma3``); MLP and norm weights are stacked over all layers, mixer weights
over the layers of their kind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator

from jaxkv import Cache, attention
from jaxkv.models.gemma3 import gemma_rms_norm
from jaxkv.models.llama import apply_rope, rms_norm
from jaxkv.models.params import checked_params, output_logits

LINEAR, FULL = "linear_attention", "full_attention"


class Qwen3_5Config(BaseModel):
    """The fields of a Qwen3.5 text ``config.json`` (``qwen3_5_text``) this model reads."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt
    linear_conv_kernel_dim: PositiveInt = 4
    linear_key_head_dim: PositiveInt
    linear_value_head_dim: PositiveInt
    linear_num_key_heads: PositiveInt
    linear_num_value_heads: PositiveInt
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    max_position_embeddings: PositiveInt = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

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


def param_shapes(config: Qwen3_5Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape; per-layer ones carry a leading axis over ``param_layers``."""
    shapes = {"embed": (config.vocab_size, config.hidden_size), "norm": (config.hidden_size,)}
    shapes |= {name: (len(param_layers(config, name)), *shape) for name, shape in layer_shapes(config).items()}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
    return shapes


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


class Qwen3_5(nnx.Module):
    """``logits, cache = model(tokens [B, T], positions [B, T], cache)``; positions < 0 are padding."""

    def __init__(self, config: Qwen3_5Config, params: dict | None = None, *, dtype=jnp.float32, seed: int = 0):
        """``params``: arrays named as ``param_shapes`` gives (``x @ w`` layout, ``1 + w``
        norms except the gated norm, which multiplies by w), e.g. from ``jaxkv.models.weights``;
        random if None."""
        self.config = config
        random = params is None
        params = checked_params("Qwen3_5", param_shapes(config), params, dtype=dtype, seed=seed, norm_value=0.0)
        if random:  # the gated norm multiplies by w, not 1 + w: start it at 1
            params["gated_norm"] = jnp.ones_like(params["gated_norm"])
        self.embed = nnx.Param(jnp.asarray(params["embed"]))
        self.layers = nnx.Dict({name: nnx.Param(jnp.asarray(params[name])) for name in layer_shapes(config)})
        self.norm = nnx.Param(jnp.asarray(params["norm"]))
        self.lm_head = None if config.tie_word_embeddings else nnx.Param(jnp.asarray(params["lm_head"]))

    def init_cache(self, batch_size: int, max_length: int | None = None, **cache_kwargs) -> Cache:
        """A stacked cache: conv + delta-rule state for linear layers (sizes read from the
        config's ``linear_*`` fields), K/V for full ones; ``cache_kwargs`` go to
        ``Cache.from_layer_types``."""
        return Cache.from_config(
            self.config,
            batch_size,
            max_length=max_length,
            dtype=cache_kwargs.pop("dtype", self.embed[...].dtype),
            stacked=True,
            **cache_kwargs,
        )

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Cache, logits_index=None):
        """Logits ``[B, T, V]`` (float32), or ``[B, 1, V]`` at ``logits_index`` ``[B]``, and the cache."""
        config = self.config
        batch, length = tokens.shape
        eps = config.rms_norm_eps
        rot = config.rotary_dim
        inv_freq = 1.0 / config.rope_theta ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot)

        def rope(x):  # RoPE on the first `rot` dims of each head, the rest passes through
            return jnp.concatenate([apply_rope(x[..., :rot], positions, inv_freq), x[..., rot:]], axis=-1)

        def full_attention(h, cache, w, layer):
            hd, heads = config.head_dim, config.num_attention_heads
            q_and_gate = (h @ w["wq"]).reshape(batch, length, heads, 2 * hd)
            q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:].reshape(batch, length, heads * hd)
            q = gemma_rms_norm(q, w["q_norm"], eps).transpose(0, 2, 1, 3)
            k = gemma_rms_norm((h @ w["wk"]).reshape(batch, length, -1, hd), w["k_norm"], eps).transpose(0, 2, 1, 3)
            v = (h @ w["wv"]).reshape(batch, length, -1, hd).transpose(0, 2, 1, 3)
            cache, kv = cache.update(layer, rope(k), v, positions)
            out = attention(rope(q), kv, positions).transpose(0, 2, 1, 3).reshape(batch, length, -1)
            return (out * jax.nn.sigmoid(gate)) @ w["wo"], cache

        def linear_attention(h, cache, w, layer):
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

            cache, out = cache.update_state(layer, h @ w["in_qkv"], positions, conv_fn, delta_rule_step)
            z = (h @ w["in_z"]).reshape(batch, length, v_heads, dv)
            out = rms_norm(out, w["gated_norm"], eps) * jax.nn.silu(z.astype(jnp.float32))
            return out.reshape(batch, length, -1).astype(h.dtype) @ w["out"], cache

        def decoder_layer(x, cache, w, group, index):
            """Layer ``index * period + group``: ``group`` static (its kind), ``index`` may be traced."""
            mixer = linear_attention if config.layer_types[group] == LINEAR else full_attention
            out, cache = mixer(gemma_rms_norm(x, w["attn_norm"], eps), cache, w, (group, index))
            x = x + out
            h = gemma_rms_norm(x, w["mlp_norm"], eps)
            return x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"], cache

        period = cache.period
        repeats, remainder = divmod(config.num_hidden_layers, period)
        pattern = config.layer_types[:period]
        weights = {name: param[...] for name, param in self.layers.items()}

        def layer_weights(group, index):
            """Weights of layer ``index * period + group``: shared ones are stacked over all
            layers, mixer ones over the layers of its kind (``param_layers``)."""
            kind = pattern[group]
            shared = {name: weights[name][index * period + group] for name in shared_shapes(config)}
            per_repeat, before = pattern.count(kind), pattern[:group].count(kind)
            mixer = linear_shapes(config) if kind == LINEAR else full_shapes(config)
            return shared | {name: weights[name][index * per_repeat + before] for name in mixer}

        def pattern_repeat(carry, _):
            x, cache, r = carry
            for group in range(period):
                x, cache = decoder_layer(x, cache, layer_weights(group, r), group, r)
            return (x, cache, r + 1), None

        embed = self.embed[...]
        (x, cache, _), _ = jax.lax.scan(pattern_repeat, (embed[tokens], cache, jnp.int32(0)), length=repeats)
        for group in range(remainder):  # layers after the last full repeat
            x, cache = decoder_layer(x, cache, layer_weights(group, repeats), group, repeats)

        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)
        x = gemma_rms_norm(x, self.norm[...], eps)
        logits = output_logits(x, embed, None if self.lm_head is None else self.lm_head[...])
        return logits, cache
