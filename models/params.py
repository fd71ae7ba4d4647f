"""Parameter set-up shared by the model files: random init, or checks on loaded arrays."""

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
