"""Shared by the model files: parameter set-up (random init, or checks on loaded arrays) and
the output head."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def checked_params(owner: str, shapes: dict, params: dict | None, *, dtype, seed: int, norm_value: float) -> dict:
    """``params`` checked against ``shapes`` (names and shapes), or random ones if None.

    Random norms are ``norm_value`` (1 where the norm multiplies by w, 0 where by 1 + w),
    everything else N(0, 0.02). Errors name the model, the parameter and both shapes.
    """
    if params is None:
        keys = iter(jax.random.split(jax.random.key(seed), len(shapes)))
        return {
            name: jnp.full(shape, norm_value, dtype) if "norm" in name else 0.02 * jax.random.normal(next(keys), shape, dtype)
            for name, shape in shapes.items()
        }
    missing, extra = sorted(set(shapes) - set(params)), sorted(set(params) - set(shapes))
    if missing or extra:
        raise ValueError(f"{owner} params: missing {missing}, unexpected {extra}")
    for name, shape in shapes.items():
        if tuple(params[name].shape) != shape:
            raise ValueError(f"{owner} param {name!r} has shape {tuple(params[name].shape)}, expected {shape}")
    return params


def output_logits(x: jax.Array, embed: jax.Array, lm_head: jax.Array | None = None) -> jax.Array:
    """Logits ``[B, T, V]`` (float32) of final hidden states ``x`` ``[B, T, D]``: through
    ``lm_head`` ``[D, V]`` when the model has one, else the tied ``embed`` ``[V, D]``.

    The tied product is written ``embed @ x.T`` (the table as the dot's left operand):
    XLA's CPU dot runs it 1.7x faster at 8 rows than ``x @ embed.T`` (SmolLM2's 49k x 576
    table: 7.9 vs 13.6 ms), the same at one row."""
    if lm_head is not None:
        return jnp.einsum("btd,dv->btv", x, lm_head, preferred_element_type=jnp.float32)
    batch, length, dim = x.shape
    rows = x.reshape(batch * length, dim)
    logits = jax.lax.dot_general(embed, rows, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return logits.T.reshape(batch, length, -1)
