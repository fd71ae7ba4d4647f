"""Decoding strategies over any model that keeps the model contract (``jaxkv.decoding.generate``):
plain sampling, beam search, speculative decoding and chat sessions."""
