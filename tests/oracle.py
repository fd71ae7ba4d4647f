"""Attention over a whole sequence without any cache: the oracle every layer must match."""

import numpy as np


def full_attention(q, k, v, *, window=None, chunk=None, scale=None):
    """One row: ``q`` ``[H_q, L, D]``, ``k``/``v`` ``[H_kv, L, D]`` -> ``[H_q, L, D]`` (float64).

    Causal; with ``window`` a query at i sees ``(i - window, i]``; with ``chunk`` only keys
    of its own chunk.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    num_heads, length, head_dim = q.shape
    group = num_heads // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    scale = head_dim**-0.5 if scale is None else scale
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    if chunk is not None:
        mask &= (j // chunk) == (i // chunk)
    logits = np.einsum("hid,hjd->hij", q, k) * scale
    logits = np.where(mask, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("hij,hjd->hid", weights, v)
