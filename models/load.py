"""One call from a model name or path to a ready model and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from jaxkv.models.defaults import resolve_model
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama
from jaxkv.models.qwen3_5 import Qwen3_5, Qwen3_5Config
from jaxkv.models.tokenizer import Tokenizer
from jaxkv.models.weights import load_gguf, load_safetensors_checkpoint, open_gguf


def load_pretrained(
    name_or_path: str | Path, dtype=jnp.float32, *, single_row_decode: bool = False, **model_kwargs
) -> tuple[Llama | Gemma3 | Qwen3_5, Tokenizer]:
    """An embedded default's name (``smollm2``, ``gemma3``), a GGUF file or a HF checkpoint
    directory; the model class follows the config (``Gemma3`` for Gemma 3, ``Qwen3_5`` for
    Qwen3.5 text, else ``Llama``).
    ``model_kwargs`` go to the model class (e.g. ``scan_layers=False`` for ``Llama``).
    ``single_row_decode``: the model will decode one row one token at a time (no batch,
    beams or speculative rounds); a ``Llama`` then stores its matrices in the layout that
    step reads fastest (``weight_layout="out_in"``)."""
    path = resolve_model(name_or_path)
    if path.suffix == ".gguf":
        reader = open_gguf(path)  # parsed once for both
        config, params = load_gguf(path, dtype, reader)
        tokenizer = Tokenizer.from_gguf(path, reader)
    else:
        config, params = load_safetensors_checkpoint(path, dtype)
        tokenizer_config = path / "tokenizer_config.json"
        tokenizer = Tokenizer.from_file(path / "tokenizer.json", tokenizer_config if tokenizer_config.is_file() else None)
    model_class = {Gemma3Config: Gemma3, Qwen3_5Config: Qwen3_5}.get(type(config), Llama)
    if single_row_decode and model_class is Llama:
        model_kwargs.setdefault("weight_layout", "out_in")
    return model_class(config, params, **model_kwargs), tokenizer
