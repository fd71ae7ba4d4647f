"""What the model files share: the decoder config base, norms, RoPE, parameter checks, the
output head, and the base class that holds a decoder's embedding, final norm and head and
builds its cache.

Each model file keeps what makes it that model (its layer, its config's extra fields and
its HF-name fixes); everything here is computed exactly as each model computed it before.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import BaseModel, ConfigDict, PositiveInt

from jaxkv.cache import Cache
from jaxkv.hugepages import on_huge_pages
from jaxkv.kernels.quantized import is_quantized
from jaxkv.sharding import EMBED, KV_HEADS, LAYERS, Q_HEADS, VOCAB, Axes, Layout

Norm = Callable[[jax.Array, jax.Array, float], jax.Array]


class DecoderConfig(BaseModel):
    """The fields of a HF decoder ``config.json`` every decoder here reads, under HF's names
    (which ``Cache.from_config`` reads too). A model's config adds its own fields and sets
    the defaults its transformers config has; other keys are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # hashable: the config is static under jit
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None  # None: one K/V head per query head
    head_dim: PositiveInt | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: PositiveInt  # the longest sequence decoding may run to
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


# --- norms ------------------------------------------------------------------------------
def _normalized(x: jax.Array, eps: float) -> jax.Array:
    """``x`` divided by the root mean square of its last axis, in float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of the last axis scaled by ``weight`` (Llama), computed in float32."""
    return (_normalized(x, eps) * weight.astype(jnp.float32)).astype(x.dtype)


def offset_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of the last axis scaled by ``1 + weight`` in float32 (Gemma 3, Qwen3.5: their
    checkpoints store ``w``, so a zero weight is the identity scale)."""
    return (_normalized(x, eps) * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


# --- RoPE -------------------------------------------------------------------------------
def inverse_frequencies(theta: float, dim: int) -> jax.Array:
    """RoPE's unscaled inverse frequencies ``[dim / 2]``: ``theta ** (-2i / dim)``."""
    return 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate ``x`` ``[B, H, T, D]`` at ``positions`` ``[B, T]`` (HF's rotate-half layout)."""
    angles = positions[:, None, :, None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# --- parameters -------------------------------------------------------------------------
def decoder_param_shapes(
    config: DecoderConfig, per_layer: dict[str, tuple[int, ...]], stacked: dict[str, int] | None = None
) -> dict[str, tuple[int, ...]]:
    """Every parameter of a decoder: ``embed`` ``[V, D]``, the final ``norm`` ``[D]``, each
    ``per_layer`` shape stacked on a leading axis of ``stacked[name]`` layers (default: all
    of them), and ``lm_head`` ``[D, V]`` unless tied. The order is the order random
    parameters are drawn in (``checked_params``)."""
    stacked = stacked or {}
    layers = {name: (stacked.get(name, config.num_hidden_layers), *shape) for name, shape in per_layer.items()}
    shapes = {"embed": (config.vocab_size, config.hidden_size), "norm": (config.hidden_size,)} | layers
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
    return shapes


def decoder_param_axes(config: DecoderConfig, per_layer: dict[str, Axes]) -> dict[str, Axes]:
    """The logical axes (``jaxkv.sharding``) of every parameter ``decoder_param_shapes`` names:
    ``per_layer`` ones after a leading ``layers`` axis."""
    axes = {"embed": Axes(VOCAB, EMBED), "norm": Axes(EMBED)}
    axes |= {name: Axes(LAYERS, *layer_axes) for name, layer_axes in per_layer.items()}
    if not config.tie_word_embeddings:
        axes["lm_head"] = Axes(EMBED, VOCAB)
    return axes


def head_units(config: DecoderConfig) -> dict[str, int]:
    """Heads per flattened ``heads x head_dim`` weight dimension: a mesh axis shards whole heads."""
    return {Q_HEADS: config.num_attention_heads, KV_HEADS: config.kv_heads}


def checked_params(owner: str, shapes: dict, params: dict | None, *, dtype, seed: int, norm_value: float) -> dict:
    """``params`` checked against ``shapes`` (names and shapes), or random ones if None.

    Random norms are ``norm_value`` (1 where the norm multiplies by w, 0 where by 1 + w),
    everything else N(0, 0.02). Errors name the model, the parameter and both shapes.
    """
    if params is None:
        keys = iter(jax.random.split(jax.random.key(seed), len(shapes)))
        return {
            name: jnp.full(shape, norm_value, dtype)
            if "norm" in name
            else 0.02 * jax.random.normal(next(keys), shape, dtype)
            for name, shape in shapes.items()
        }
    missing, extra = sorted(set(shapes) - set(params)), sorted(set(params) - set(shapes))
    if missing or extra:
        raise ValueError(f"{owner} params: missing {missing}, unexpected {extra}")
    for name, shape in shapes.items():
        # A matrix kept in its file's blocks is stored [out, in] (``Decoder.layer_param``); a table is [V, D].
        kept = is_quantized(params[name]) and name not in ("embed", "norm")
        expected = (*shape[:-2], shape[-1], shape[-2]) if kept else shape
        if tuple(params[name].shape) != expected:
            raise ValueError(f"{owner} param {name!r} has shape {tuple(params[name].shape)}, expected {expected}")
    return params


# --- the output head --------------------------------------------------------------------
def at_logits_index(x: jax.Array, logits_index: jax.Array | None) -> jax.Array:
    """``x`` ``[B, T, D]``, or each row's one position ``logits_index`` ``[B]``: ``[B, 1, D]``
    (a prefill needs the logits of each row's last prompt token only), or K positions
    ``[B, K]``: ``[B, K, D]`` (a serving step packs many requests into one row)."""
    if logits_index is None:
        return x
    index = logits_index if logits_index.ndim == 2 else logits_index[:, None]
    return jnp.take_along_axis(x, index[:, :, None], axis=1)


def layer_weights(stacks: dict, index) -> dict:
    """Layer ``index`` (an int or a traced int32) of each stacked weight ``[L, ...]`` in ``stacks``:
    an array's slice (what a scan over the stacks as ``xs`` would slice), a quantized matrix's layer
    read in place by its kernel (``QuantizedMatrix.at_layer``: no copy of its blocks)."""
    return {name: stack[index] for name, stack in stacks.items()}


def output_logits(x: jax.Array, embed: jax.Array, lm_head: jax.Array | None = None) -> jax.Array:
    """Logits ``[B, T, V]`` (float32) of final hidden states ``x`` ``[B, T, D]``: through
    ``lm_head`` ``[D, V]`` when the model has one, else the tied ``embed`` ``[V, D]``.

    The tied product is written ``embed @ x.T`` (the table as the dot's left operand):
    XLA's CPU dot runs it 1.7x faster at 8 rows than ``x @ embed.T`` (SmolLM2's 49k x 576
    table: 7.9 vs 13.6 ms), the same at one row."""
    if is_quantized(lm_head if lm_head is not None else embed):  # [V, D] blocks, either way
        table = lm_head if lm_head is not None else embed
        return (x @ table.T).astype(jnp.float32)
    if lm_head is not None:
        return jnp.einsum("btd,dv->btv", x, lm_head, preferred_element_type=jnp.float32)
    batch, length, dim = x.shape
    rows = x.reshape(batch * length, dim)
    logits = jax.lax.dot_general(embed, rows, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return logits.T.reshape(batch, length, -1)


# --- the decoder around its layers ------------------------------------------------------
WEIGHT_LAYOUTS = ("out_in", "in_out")


class Decoder(nnx.Module):
    """What Llama, Gemma3 and Qwen3_5 hold outside their layers: ``embed`` ``[V, D]``, the
    final ``norm`` ``[D]`` and ``lm_head`` ``[D, V]`` (None when tied to ``embed``); the mesh
    their weights are sharded over (``layout``, None on one device); and the cache they read
    and write (``init_cache``)."""

    def __init__(
        self, config: DecoderConfig, params: dict, axes: dict[str, Axes], mesh=None, rules=None,
        weight_layout: str = "out_in",
    ):  # fmt: skip
        """``params``: checked by the model (``checked_params``); its layer weights are the model's.
        ``axes``: every parameter's logical axes. ``mesh``, ``rules``: shard the parameters (and
        the caches ``init_cache`` builds) over ``mesh`` by those axes (``jaxkv.sharding``).
        ``weight_layout``: how the model stores its layer matrices (``layer_param``, ``matmul``)."""
        if weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
        self.config = config
        self.weight_layout = weight_layout
        self.layout = None if mesh is None else Layout.create(mesh, rules)
        self.embed = self.param(params["embed"], axes["embed"])
        self.norm = self.param(params["norm"], axes["norm"])
        self.lm_head = None if config.tie_word_embeddings else self.param(params["lm_head"], axes["lm_head"])

    def param(self, array, axes: Axes) -> nnx.Param:
        """``array`` as a parameter, sharded by its logical ``axes`` when the model has a layout,
        else on huge pages in host memory (``jaxkv.hugepages``: a decode step streams every weight)."""
        if self.layout is None:
            return nnx.Param(jax.tree.map(on_huge_pages, array))
        if is_quantized(array):
            raise ValueError("weights kept quantized do not shard over a mesh yet: load them dense (weights='dense')")
        return nnx.Param(self.layout.place(array, axes, head_units(self.config)))

    def layer_param(self, array, axes: Axes, matrix: bool) -> nnx.Param:
        """A layer weight (``x @ w`` layout, ``[..., in, out]``) as a parameter; a ``matrix`` under
        ``weight_layout="out_in"`` is stored transposed, ``[..., out, in]``, as PyTorch stores it.

        Why "out_in" is the default: ``matmul`` then computes ``x @ w.T``, which XLA's CPU backend
        fuses with a scanned layer's weight slice into a matrix-vector loop when one row decodes
        (no copy of the slice; ``[in, out]`` copies every layer's weights out of the stack each
        step), while at 8 rows it runs the same GEMMs as ``[in, out]`` (a copy and transpose of
        the slice instead of a copy). SmolLM2 float32 (median of 3 fresh processes):
        batch 1 67.8 tok/s vs 49.4, batch 8 213.8 vs 188.5."""
        if is_quantized(array):  # blocks run along a row: always [out, in]
            if self.weight_layout != "out_in":
                raise ValueError("weights kept quantized are stored [out, in]: use weight_layout='out_in'")
            return self.param(array, axes)
        if matrix and self.weight_layout == "out_in":  # swapped where it is (a host array stays on the host)
            array, axes = array.swapaxes(-1, -2), Axes(*axes[:-2], axes[-1], axes[-2])
        return self.param(array, axes)

    def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """``x @ w`` of a layer matrix stored by ``layer_param``: ``x @ w.T`` for "out_in" (written
        so, not as a dot_general on ``w``: the form XLA fuses with the slice)."""
        return x @ w.T if self.weight_layout == "out_in" else x @ w

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The embedding rows ``[B, T, D]`` of ``tokens`` ``[B, T]`` (dequantized rows of a kept table)."""
        embed = self.embed[...]
        return embed.take_rows(tokens, self.norm[...].dtype) if is_quantized(embed) else embed[tokens]

    def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
        """Activations ``x`` sharded by their logical ``axes`` (unchanged on one device): the
        batch rows of a data-parallel run stay on their devices from the embedding on. What does
        not divide is replicated (the serving engine packs its tokens into one row)."""
        if self.layout is None:
            return x
        sharding = self.layout.sharding(axes, x.shape, head_units(self.config), quiet=True)
        return jax.lax.with_sharding_constraint(x, sharding)

    def init_cache(self, batch_size: int, max_length: int | None = None, **cache_kwargs) -> Cache:
        """A cache for this model, one layer per ``layer_types`` entry of the config (or its
        inferred types), stacked over the repeats of its layer pattern, as the model's scan
        reads it; in the weights' dtype unless ``dtype`` is given. ``cache_kwargs`` go to
        ``Cache.from_config`` (``full_attention``, ``rollback_slots``, ``quantization``...); a
        sharded model's cache is sharded over the same mesh and rules."""
        cache_kwargs.setdefault("dtype", self.embed[...].dtype)
        if self.layout is not None:
            cache_kwargs.setdefault("mesh", self.layout.mesh)
            cache_kwargs.setdefault("rules", dict(self.layout.rules))
        return Cache.from_config(self.config, batch_size, max_length=max_length, stacked=True, **cache_kwargs)

    def head(self, x: jax.Array, logits_index: jax.Array | None, norm: Norm) -> jax.Array:
        """Logits ``[B, T, V]`` (float32) of the last layer's output ``x`` ``[B, T, D]``, or
        ``[B, 1, V]`` at ``logits_index`` ``[B]``: the final ``norm``, then ``output_logits``."""
        x = norm(at_logits_index(x, logits_index), self.norm[...], self.config.rms_norm_eps)
        return output_logits(x, self.embed[...], None if self.lm_head is None else self.lm_head[...])


def check_num_layers(config: DecoderConfig, num_layers: int | None) -> int:
    """How many layers an (early-exit) call runs: all when ``num_layers`` is None."""
    depth = config.num_hidden_layers if num_layers is None else num_layers
    if not 1 <= depth <= config.num_hidden_layers:
        raise ValueError(f"num_layers must be in [1, {config.num_hidden_layers}], got {num_layers}")
    return depth
