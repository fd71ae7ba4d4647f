"""Decoding strategies over any model that keeps the model contract (``jaxkv.decoding.model``):
plain sampling (``generate``), beam search (``beam``), speculative decoding (``speculative``)
and chat sessions (``session``), all run by one driver (``driver``: batch, prefill, loop,
timings); ``sampling`` draws tokens from logits."""
