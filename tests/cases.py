"""What the layer tests share: small layers of each kind, and random feed / rollback plans."""

from hypothesis import strategies as st

from jaxkv import ChunkedLayer, DynamicLayer, SlidingWindowLayer, StaticLayer


def make_layer(kind, *, batch=1, heads=1, head_dim=1, span=4, max_length=24, rollback_slots=0):
    """A ``static``, ``dynamic``, ``sliding`` or ``chunked`` layer (``span``: window or chunk)."""
    if kind == "static":
        return StaticLayer.create(batch, heads, head_dim, max_length)
    if kind == "dynamic":
        return DynamicLayer.create(batch, heads, head_dim)
    cls = SlidingWindowLayer if kind == "sliding" else ChunkedLayer
    return cls.create(batch, heads, head_dim, span, rollback_slots=rollback_slots)


@st.composite
def feed_rollback_plans(draw, batch: int, budget: int, max_len: int, max_steps: int, rollback_draws: int = 1):
    """Steps ``("feed", width, counts)`` (row b takes ``counts[b]`` real tokens of ``width``, the
    rest padding) and ``("rollback", undo)`` (row b undoes ``undo[b]``).

    A rollback comes before a feed when ``rollback_draws`` coin flips all say so. Rollbacks
    without a feed in between share a budget, so a row undoes at most ``budget`` tokens below
    the longest it has been; rows never pass ``max_len`` tokens.
    """
    lengths, longest, steps = [0] * batch, [0] * batch, []
    for step in range(draw(st.integers(1, max_steps))):
        if step and budget and all(draw(st.booleans()) for _ in range(rollback_draws)):
            undo = [draw(st.integers(0, min(n, budget - (top - n)))) for n, top in zip(lengths, longest)]
            lengths = [n - u for n, u in zip(lengths, undo)]
            steps.append(("rollback", undo))
        width = draw(st.sampled_from([1, 1, 3, 8]))
        counts = [draw(st.integers(0, min(width, max_len - n))) for n in lengths]
        lengths = [n + c for n, c in zip(lengths, counts)]
        longest = [max(n, top) for n, top in zip(lengths, longest)]
        steps.append(("feed", width, counts))
    return steps
