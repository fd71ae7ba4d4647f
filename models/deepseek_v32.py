"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): MLA attention with DSA's lightning indexer, and a
mixture-of-experts feed-forward, in one readable file.

Follow one token: ``embed`` -> for each layer (scanned): RMSNorm -> MLA (``attention``: the query
through its low-rank ``q_a``/``q_b``, the K/V compressed to a normalised latent plus one shared
RoPE key, stored by an ``indexed_attention`` cache layer, ``jaxkv.layers.indexed``) -> output
projection -> residual -> RMSNorm -> feed-forward (the first ``first_k_dense_replace`` layers a
SwiGLU MLP, the others ``moe``: routed experts chosen per token plus shared experts) -> residual;
then the final RMSNorm and the LM head.

The indexer scores every cached token for each query and attention reads the ``index_topk``
best (``jaxkv.layers.indexed``); the MLA attention runs in the absorbed form or the plain one,
whichever costs less for the call (``jaxkv.mla``). The dense layers and the MoE layers
each run in one ``lax.scan`` (their weights differ in shape), with the cache in the carry.
The MoE is a dense reference: every expert runs on every token, the router's weights pick.

RoPE: ``default`` or ``yarn`` (the released checkpoints': factor 40 over 4096 positions, whose
``mscale_all_dim`` also scales the softmax); MLA rotates interleaved pairs, the indexer the halves
(as transformers does).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxkv.models.common import (
    Decoder,
    DecoderConfig,
    apply_rope,
    checked_params,
    decoder_param_axes,
    decoder_param_shapes,
    inverse_frequencies,
    rms_norm,
)  # fmt: skip
from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, model_validator

from jaxkv.cache import Cache
from jaxkv.layers.indexed import IndexedQueries, IndexerQueries
from jaxkv.mla import LatentQueries, LatentWeights
from jaxkv.sharding import EMBED, MLP, Q_HEADS, Axes

SUB_NORM_EPS = 1e-6  # transformers' q_a / kv_a RMSNorms and the indexer's LayerNorm use their default eps


class YarnScaling(BaseModel):
    """``rope_parameters`` of ``rope_type`` 'yarn' (transformers' names and defaults)."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # hashable: the config is static under jit
    original_max_position_embeddings: PositiveInt
    factor: float | None = None  # None: max_position_embeddings / original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


class DeepseekV32Config(DecoderConfig):
    """The fields of a DeepSeek-V3.2 ``config.json`` this model reads (others are ignored)."""

    max_position_embeddings: PositiveInt = 163840
    rope_theta: float = 10_000.0
    rope_scaling: YarnScaling | None = None
    q_lora_rank: PositiveInt
    kv_lora_rank: PositiveInt
    qk_nope_head_dim: PositiveInt
    qk_rope_head_dim: PositiveInt
    v_head_dim: PositiveInt
    moe_intermediate_size: PositiveInt
    n_routed_experts: PositiveInt
    n_shared_experts: PositiveInt = 1
    num_experts_per_tok: PositiveInt
    n_group: PositiveInt = 1
    topk_group: PositiveInt = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: NonNegativeInt = 0
    index_topk: PositiveInt
    index_head_dim: PositiveInt
    index_n_heads: PositiveInt
    layer_types: tuple[str, ...] | None = None

    @model_validator(mode="before")
    @classmethod
    def from_hf_names(cls, data):
        """Read v5's ``rope_parameters`` and ``mlp_layer_types``; refuse what this model does not implement."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        rope = data.pop("rope_parameters", None) or {}
        kind = rope.get("rope_type", "default")
        if kind not in ("default", "yarn"):
            raise ValueError(f"rope_type {kind!r} is not supported by jaxkv.models.deepseek_v32 (default or yarn)")
        data.setdefault("rope_theta", rope.get("rope_theta", 10_000.0))
        if kind == "yarn":
            data.setdefault("rope_scaling", rope)
        for flag in ("attention_bias", "mlp_bias"):
            if data.get(flag):
                raise ValueError(f"{flag}=True is not supported by jaxkv.models.deepseek_v32")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {data['hidden_act']!r} is not supported by jaxkv.models.deepseek_v32")
        mlp_types = data.pop("mlp_layer_types", None)
        if mlp_types is not None:
            dense = mlp_types.count("dense")
            if list(mlp_types) != ["dense"] * dense + ["sparse"] * (len(mlp_types) - dense):
                raise ValueError(f"mlp_layer_types must be dense layers then sparse ones, got {mlp_types}")
            data["first_k_dense_replace"] = dense
        return data

    @model_validator(mode="after")
    def check_shapes(self):
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ValueError(f"n_routed_experts {self.n_routed_experts} must split into n_group {self.n_group} of 2+")
        if self.qk_rope_head_dim > self.index_head_dim or self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even and at most index_head_dim")
        return self

    @property
    def num_dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def yarn_factor(self) -> float:
        scaling = self.rope_scaling
        return scaling.factor or self.max_position_embeddings / scaling.original_max_position_embeddings

    @property
    def softmax_scale(self) -> float:
        """``(n + P) ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when it has one."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope_scaling is None or not self.rope_scaling.mscale_all_dim:
            return scale
        return scale * yarn_mscale(self.yarn_factor, self.rope_scaling.mscale_all_dim) ** 2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 · mscale · ln(factor) + 1`` (1 for a factor up to 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class Rotation:
    """RoPE as the config sets it: ``inv_freq`` ``[P / 2]`` and the factor YaRN scales cos and sin by."""

    inv_freq: jax.Array
    attention_factor: float = 1.0

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x`` ``[B, H, T, P]`` rotated (halves layout) at ``positions`` ``[B, T]``."""
        return apply_rope(x, positions, self.inv_freq) * self.attention_factor


def rotation(c: DeepseekV32Config) -> Rotation:
    """The config's RoPE: default, or YaRN's blend of interpolated and extrapolated frequencies
    (transformers' ``_compute_yarn_parameters``)."""
    dim, inv_freq, scaling = c.qk_rope_head_dim, inverse_frequencies(c.rope_theta, c.qk_rope_head_dim), c.rope_scaling
    if scaling is None:
        return Rotation(inv_freq)
    factor = c.yarn_factor
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        both = scaling.mscale and scaling.mscale_all_dim
        attention_factor = (
            yarn_mscale(factor, scaling.mscale) / yarn_mscale(factor, scaling.mscale_all_dim)
            if both
            else yarn_mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        wavelength = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelength) / (2 * math.log(c.rope_theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low if high != low else 0.001), 0, 1)
    return Rotation(inv_freq / factor * ramp + inv_freq * (1 - ramp), attention_factor)


def attention_shapes(c: DeepseekV32Config) -> dict[str, tuple[int, ...]]:
    """Every layer's attention (and norm) weights, ``x @ w`` layout."""
    heads, d = c.num_attention_heads, c.hidden_size
    return {
        "attn_norm": (d,), "mlp_norm": (d,),
        "wq_a": (d, c.q_lora_rank), "q_a_norm": (c.q_lora_rank,),
        "wq_b": (c.q_lora_rank, heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)),
        "wkv_a": (d, c.kv_lora_rank + c.qk_rope_head_dim), "kv_a_norm": (c.kv_lora_rank,),
        "wkv_b": (c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim)), "wo": (heads * c.v_head_dim, d),
        "iwq": (c.q_lora_rank, c.index_n_heads * c.index_head_dim), "iwk": (d, c.index_head_dim),
        "ik_norm": (c.index_head_dim,), "ik_bias": (c.index_head_dim,), "iw": (d, c.index_n_heads),
    }  # fmt: skip


def dense_shapes(c: DeepseekV32Config) -> dict[str, tuple[int, ...]]:
    """The SwiGLU MLP of the first ``first_k_dense_replace`` layers."""
    d, ff = c.hidden_size, c.intermediate_size
    return {"w_gate": (d, ff), "w_up": (d, ff), "w_down": (ff, d)}


def moe_shapes(c: DeepseekV32Config) -> dict[str, tuple[int, ...]]:
    """The MoE of the other layers: router, routed experts ``[E, ...]``, shared experts."""
    d, e, ff = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
    shared = ff * c.n_shared_experts
    return {
        "router": (d, e), "router_bias": (e,),
        "experts_gate": (e, d, ff), "experts_up": (e, d, ff), "experts_down": (e, ff, d),
        "shared_gate": (d, shared), "shared_up": (d, shared), "shared_down": (shared, d),
    }  # fmt: skip


def layer_shapes(c: DeepseekV32Config) -> dict[str, tuple[int, ...]]:
    """Per-layer weights (without the leading layer axis) of every kind."""
    return attention_shapes(c) | dense_shapes(c) | moe_shapes(c)


def param_layers(c: DeepseekV32Config, name: str) -> list[int]:
    """The layers whose weights a stacked parameter holds, in stacking order."""
    if name in dense_shapes(c):
        return list(range(c.num_dense_layers))
    if name in moe_shapes(c):
        return list(range(c.num_dense_layers, c.num_hidden_layers))
    return list(range(c.num_hidden_layers))


def param_shapes(c: DeepseekV32Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape; per-layer ones carry a leading axis over their layers."""
    counts = {name: len(param_layers(c, name)) for name in layer_shapes(c)}
    return decoder_param_shapes(c, layer_shapes(c), counts)


def param_axes(c: DeepseekV32Config) -> dict[str, Axes]:
    """Logical axes: replicated but for the heads of the query/output projections and the MLP widths."""
    axes = {name: Axes(*[None] * len(shape)) for name, shape in layer_shapes(c).items()}
    axes |= {"wq_b": Axes(None, Q_HEADS), "wo": Axes(Q_HEADS, EMBED)}
    axes |= {name: Axes(EMBED, MLP) for name in ("w_gate", "w_up", "shared_gate", "shared_up")}
    axes |= {name: Axes(MLP, EMBED) for name in ("w_down", "shared_down")}
    return decoder_param_axes(c, axes)


def mla_rope(x: jax.Array, positions: jax.Array, rotate: Rotation) -> jax.Array:
    """MLA's RoPE of ``x`` ``[B, H, T, P]``: interleaved pairs ``(x0, x1), (x2, x3)...`` rotated, the
    result laid out as the halves ``[even', odd']`` (transformers' layout; q and k alike)."""
    return rotate(jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1), positions)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm of the last axis in float32 (the indexer's key norm)."""
    x32 = x.astype(jnp.float32)
    centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    return (normed * weight + bias).astype(x.dtype)


def indexer_inputs(c: DeepseekV32Config, w: dict, h, q_resid, positions, rotate: Rotation):
    """The lightning indexer's queries and keys of one layer: ``IndexerQueries`` (``[B, T, H_I, D_I]``
    scaled by ``D_I ** -0.5``, weights ``[B, T, H_I]`` scaled by ``H_I ** -0.5``) and the keys
    ``[B, T, D_I]``, from the normed input ``h`` ``[B, T, D]`` and the query latent ``q_resid``."""
    batch, length, _ = h.shape
    rope = c.qk_rope_head_dim
    queries = (q_resid @ w["iwq"]).reshape(batch, length, c.index_n_heads, c.index_head_dim)
    keys = layer_norm(h @ w["iwk"], w["ik_norm"], w["ik_bias"], SUB_NORM_EPS)
    rotated = rotate(queries[..., :rope].transpose(0, 2, 1, 3), positions).transpose(0, 2, 1, 3)
    queries = jnp.concatenate([rotated, queries[..., rope:]], axis=-1) * c.index_head_dim**-0.5
    keys = jnp.concatenate([rotate(keys[:, None, :, :rope], positions)[:, 0], keys[..., rope:]], axis=-1)
    weights = (h @ w["iw"]).astype(jnp.float32) * c.index_n_heads**-0.5
    return IndexerQueries(queries, weights), keys


def attention(c: DeepseekV32Config, w: dict, h, positions, cache: Cache, i, rotate: Rotation, packed=None):
    """MLA with DSA of one layer: ``h`` ``[B, T, D]`` (normed) -> ``(cache, [B, T, D])``; ``packed``: a
    serving step's ``jaxkv.batch.PackedBatch``."""
    batch, length, _ = h.shape
    heads, nope, rank = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
    q_resid = rms_norm(h @ w["wq_a"], w["q_a_norm"], SUB_NORM_EPS)
    q = (q_resid @ w["wq_b"]).reshape(batch, length, heads, nope + c.qk_rope_head_dim).transpose(0, 2, 1, 3)
    compressed = h @ w["wkv_a"]
    latent = rms_norm(compressed[..., :rank], w["kv_a_norm"], SUB_NORM_EPS)
    rope_key = mla_rope(compressed[:, None, :, rank:], positions, rotate)
    entries = jnp.concatenate([latent[:, None], rope_key], axis=-1)  # [B, 1, T, R + P]
    indexer, index_keys = indexer_inputs(c, w, h, q_resid, positions, rotate)
    queries = IndexedQueries(LatentQueries(q[..., :nope], mla_rope(q[..., nope:], positions, rotate)), indexer)
    up = LatentWeights(w["wkv_b"].T.reshape(heads, nope + c.v_head_dim, rank), nope)
    scale = c.softmax_scale

    def read(latent_queries, view, q_positions, _):
        return view.attend_latent(latent_queries, q_positions, up, scale), None

    cache, out = cache.attend(i, queries, entries, index_keys[:, None], positions, read, packed)
    return cache, out.transpose(0, 2, 1, 3).reshape(batch, length, -1) @ w["wo"]


def dense_mlp(c: DeepseekV32Config, w: dict, h):
    return (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]


def route(c: DeepseekV32Config, w: dict, x):
    """Each token's routing weights over the experts ``[N, E]`` (zero where not chosen), from ``x``
    ``[N, D]``: sigmoid scores, the best ``topk_group`` groups (by their top-2 scores plus the
    correction bias), the top ``num_experts_per_tok`` experts there, normalised and scaled."""
    scores = jax.nn.sigmoid(x.astype(jnp.float32) @ w["router"].astype(jnp.float32))
    choice = scores + w["router_bias"].astype(jnp.float32)
    grouped = choice.reshape(x.shape[0], c.n_group, -1)
    _, groups = jax.lax.top_k(jax.lax.top_k(grouped, 2)[0].sum(-1), c.topk_group)
    kept = jnp.sum(jax.nn.one_hot(groups, c.n_group, dtype=bool), axis=1)  # [N, G]
    choice = jnp.where(jnp.repeat(kept, grouped.shape[-1], axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, c.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if c.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)
    weights = weights * c.routed_scaling_factor
    return jnp.einsum("nk,nke->ne", weights, jax.nn.one_hot(experts, c.n_routed_experts, dtype=weights.dtype))


def moe(c: DeepseekV32Config, w: dict, h):
    """Routed experts (every expert on every token, weighted by ``route``) plus the shared experts."""
    x = h.reshape(-1, h.shape[-1])
    hidden = jax.nn.silu(jnp.einsum("nd,edf->nef", x, w["experts_gate"])) * jnp.einsum(
        "nd,edf->nef", x, w["experts_up"]
    )
    routed = jnp.einsum("ne,nef,efd->nd", route(c, w, x).astype(x.dtype), hidden, w["experts_down"])
    shared = (jax.nn.silu(x @ w["shared_gate"]) * (x @ w["shared_up"])) @ w["shared_down"]
    return (routed + shared).reshape(h.shape)


class DeepseekV32(Decoder):
    """``logits, cache = model(tokens [B, T], positions [B, T], cache)``; positions < 0 are padding."""

    def __init__(self, config: DeepseekV32Config, params: dict | None = None, *, dtype=jnp.float32, seed: int = 0):
        """``params``: arrays named as ``param_shapes`` gives (``x @ w`` layout, stacked over each
        parameter's ``param_layers``), e.g. from ``jaxkv.models.weights``; random if None."""
        params = checked_params("DeepseekV32", param_shapes(config), params, dtype=dtype, seed=seed, norm_value=1.0)
        axes = param_axes(config)
        super().__init__(config, params, axes, weight_layout="in_out")
        self.layers = nnx.Dict({name: self.param(params[name], axes[name]) for name in layer_shapes(config)})

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Cache, logits_index=None, packed=None):
        """Logits ``[B, T, V]`` (float32), or ``[B, 1, V]`` at ``logits_index`` ``[B]`` (``[B, K]``: K
        positions), and the cache. ``packed``: a serving step's ``jaxkv.batch.PackedBatch`` (``tokens``
        ``[1, N]`` of many rows; the engine's latent layers keep one row per request)."""
        c = self.config
        rotate = rotation(c)
        weights = {name: param[...] for name, param in self.layers.items()}
        split = c.num_dense_layers

        def layer(feed_forward, carry, w):
            x, cache, i = carry
            h = rms_norm(x, w["attn_norm"], c.rms_norm_eps)
            cache, out = attention(c, w, h, positions, cache, i, rotate, packed)
            x = x + out
            return (x + feed_forward(c, w, rms_norm(x, w["mlp_norm"], c.rms_norm_eps)), cache, i + 1), None

        def stage(names, layers: slice) -> dict:
            return {name: weights[name][layers] for name in attention_shapes(c)} | {
                name: weights[name] for name in names
            }

        carry = (self.embed[...][tokens], cache, jnp.int32(0))
        if split:
            carry, _ = jax.lax.scan(functools.partial(layer, dense_mlp), carry, stage(dense_shapes(c), slice(0, split)))
        if split < c.num_hidden_layers:
            carry, _ = jax.lax.scan(functools.partial(layer, moe), carry, stage(moe_shapes(c), slice(split, None)))
        x, cache, _ = carry
        return self.head(x, logits_index, rms_norm), cache
