"""Text <-> token ids and chat prompts, on the Rust ``tokenizers`` library (no transformers).

Two sources:

* ``Tokenizer.from_gguf(path)`` rebuilds the tokenizer a llama.cpp GGUF describes in its
  ``tokenizer.*`` metadata (vocabulary, merges, token types, special ids, chat template).
  Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE, e.g. SmolLM2) and ``"llama"``
  (SentencePiece BPE with byte fallback, e.g. Gemma 3).
* ``Tokenizer.from_file(tokenizer.json, tokenizer_config.json)`` for a transformers checkpoint.

``save_pretrained(directory)`` writes either back as a transformers tokenizer directory (for
tools that load one with ``AutoTokenizer``; ``jaxkv tokenizer`` on the command line).

``apply_chat_template`` renders the model's Jinja chat template the way transformers does
(sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``), returning the prompt text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from jaxkv.models.weights import gguf_value, open_gguf

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are spelled in.

    Printable Latin-1 bytes stand for themselves; the remaining 68 (controls, space, ...) are
    shifted to code points 256 and up, in byte order, so every byte has a visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return dict(sorted(table.items()))


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    # GPT-2's regex ('s|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+), then bytes -> alphabet.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    # Every number character on its own first, then GPT-2's split: SmolLM2's tokenizer.json and
    # llama.cpp's "smollm"/"starcoder" pre-tokenizers. It matters for e.g. "a  1" (the space run
    # stays whole) and " ²" (the space does not join the number).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's names for them).
GGUF_PRE_TOKENIZERS = {
    "gpt2": _gpt2_split,
    "smollm": _digits_then_gpt2_split,
    "starcoder": _digits_then_gpt2_split,
    "refact": _digits_then_gpt2_split,
    "codeshell": _digits_then_gpt2_split,
}


def _byte_level_bpe(reader, path: Path) -> tuple[tokenizers.Tokenizer, list[str]]:
    """Byte-level BPE from ``tokenizer.ggml.{tokens,merges,token_type,pre}``; also the token list."""
    pre = gguf_value(reader, "tokenizer.ggml.pre", "gpt2")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: GGUF pre-tokenizer {pre!r} is not supported yet; supported: {sorted(GGUF_PRE_TOKENIZERS)}"
        )
    tokens = gguf_value(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in gguf_value(reader, "tokenizer.ggml.merges")]
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Some converters store a token as raw text rather than in the byte alphabet; respell it so
    # BPE can reach it (as transformers does).
    vocab = {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) must match whole in text and be skippable on decode;
    # user-defined ones match whole but are ordinary text. A control token spelled outside the
    # byte alphabet is a llama.cpp mislabel and not a real token, so it is left out.
    types = gguf_value(reader, "tokenizer.ggml.token_type", [])
    control = [t for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= spelled]
    user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return backend, tokens


_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def _merges_in_vocabulary_order(vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary that stores none.

    Every split of a token into two vocabulary pieces is a merge; merges rank by the token's
    position in the file (Gemma's scores do not follow its merge order; its order does),
    then by longer left piece. transformers derives the same list for Gemma GGUF files."""
    merges = []
    for token in sorted(vocab, key=vocab.__getitem__):
        splits = [(token[:k], token[k:]) for k in range(len(token) - 1, 0, -1)]
        merges.extend((left, right) for left, right in splits if left in vocab and right in vocab)
    return merges


def _sentencepiece_bpe(reader, path: Path) -> tuple[tokenizers.Tokenizer, list[str]]:
    """SentencePiece-style BPE (Gemma) from ``tokenizer.ggml.{tokens,token_type}``; also the token list.

    Text is not pre-split: every space becomes "▁" and BPE runs over the whole text, falling
    back to ``<0xNN>`` byte tokens for characters outside the vocabulary. No "▁" is prepended
    (Gemma's ``add_space_prefix`` is false); files that want one are refused."""
    if gguf_value(reader, "tokenizer.ggml.add_space_prefix", False):
        raise ValueError(f"{path}: SentencePiece add_space_prefix=True is not supported yet")
    tokens = gguf_value(reader, "tokenizer.ggml.tokens")
    # Runs of spaces are stored as real spaces ("  "), but text reaches BPE with "▁" for each space.
    spelled = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    unk_id = gguf_value(reader, "tokenizer.ggml.unknown_token_id", None)
    unk = None if unk_id is None else tokens[unk_id]
    model = models.BPE(
        vocab=vocab, merges=_merges_in_vocabulary_order(vocab), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])

    # Control tokens (<bos>, <start_of_turn>, ...) match whole and are skippable on decode;
    # user-defined ones ("\n\n", "<table>", ...) match whole but are ordinary text.
    types = gguf_value(reader, "tokenizer.ggml.token_type", [])
    control = [t for t, kind in zip(tokens, types) if kind == _CONTROL]
    user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return backend, tokens


# tokenizer.ggml.model -> builder(reader, path) -> (backend, tokens).
GGUF_TOKENIZERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _template_environment():
    """A sandboxed Jinja environment configured like transformers' chat-template renderer:
    templates come from model files, so they must not reach Python internals."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes (<, >, &), which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class Tokenizer:
    """``encode``/``decode`` plus the model's special ids and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        chat_template: str | None = None,
        source: str = "tokenizer",
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_tokens = list(eos_tokens)
        self.chat_template = chat_template
        self.source = source  # for error messages
        for token in [bos_token, *self.eos_tokens]:
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"{source}: special token {token!r} is not in the vocabulary")

    @classmethod
    def from_gguf(cls, path: str | Path, reader=None) -> Tokenizer:
        """The tokenizer described by a GGUF file's ``tokenizer.*`` metadata (``reader``:
        the file's ``open_gguf`` reader, if already open)."""
        path = Path(path)
        reader = reader or open_gguf(path)
        kind = gguf_value(reader, "tokenizer.ggml.model", None)
        if kind not in GGUF_TOKENIZERS:
            raise ValueError(
                f"{path}: GGUF tokenizer type {kind!r} is not supported yet; supported: {sorted(GGUF_TOKENIZERS)}"
            )
        backend, tokens = GGUF_TOKENIZERS[kind](reader, path)

        def token(key: str) -> str | None:
            index = gguf_value(reader, f"tokenizer.ggml.{key}", None)
            return None if index is None else tokens[index]

        bos, eos = token("bos_token_id"), token("eos_token_id")
        # llama.cpp also stops on end-of-turn / end-of-message tokens when a file names them.
        eos_tokens = list(dict.fromkeys(t for t in (eos, token("eot_token_id"), token("eom_token_id")) if t))
        add_bos = bool(gguf_value(reader, "tokenizer.ggml.add_bos_token", False))
        add_eos = bool(gguf_value(reader, "tokenizer.ggml.add_eos_token", False))
        if (add_bos and bos is None) or (add_eos and eos is None):
            raise ValueError(f"{path}: add_bos/add_eos is set but the BOS/EOS token id is missing")
        if add_bos or add_eos:
            added = [bos] * add_bos + [eos] * add_eos
            single = " ".join([bos] * add_bos + ["$A"] + [eos] * add_eos)
            backend.post_processor = processors.TemplateProcessing(
                single=single, special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(added)]
            )
        return cls(
            backend,
            bos_token=bos,
            eos_tokens=eos_tokens,
            chat_template=gguf_value(reader, "tokenizer.chat_template", None),
            source=str(path),
        )

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, tokenizer_config: str | Path | None = None) -> Tokenizer:
        """From a transformers ``tokenizer.json`` and, optionally, its ``tokenizer_config.json``
        (special tokens, chat template; a ``chat_template.jinja`` beside it is used too).

        BOS/EOS insertion is whatever ``tokenizer.json``'s post-processor does."""
        tokenizer_json = Path(tokenizer_json)
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"tokenizer file {tokenizer_json} does not exist")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        except Exception as err:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"{tokenizer_json} is not a valid tokenizer.json: {err}") from err
        config: dict[str, Any] = {}
        config_dir = tokenizer_json.parent
        if tokenizer_config is not None:
            tokenizer_config = Path(tokenizer_config)
            if not tokenizer_config.is_file():
                raise FileNotFoundError(f"tokenizer config {tokenizer_config} does not exist")
            config = json.loads(tokenizer_config.read_text())
            config_dir = tokenizer_config.parent

        def content(token: str | Mapping | None) -> str | None:
            return token.get("content") if isinstance(token, Mapping) else token

        template = config.get("chat_template")
        if isinstance(template, list):  # transformers' named-templates form
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_file = config_dir / "chat_template.jinja"  # where transformers >= 4.43 saves it
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        eos = config.get("eos_token")
        eos_tokens = [content(t) for t in eos] if isinstance(eos, list) else [content(eos)] if eos else []
        return cls(
            backend,
            bos_token=content(config.get("bos_token")),
            eos_tokens=eos_tokens,
            chat_template=template,
            source=str(tokenizer_json),
        )

    def state(self) -> dict[str, str]:
        """This tokenizer as strings, which ``from_state`` turns back into an equal one: the
        backend's ``tokenizer.json`` text, and the special tokens, chat template and source as JSON."""
        special = {"bos_token": self.bos_token, "eos_tokens": self.eos_tokens, "chat_template": self.chat_template}
        return {"tokenizer": self.backend.to_str(), "tokenizer_config": json.dumps(special | {"source": self.source})}

    @classmethod
    def from_state(cls, state: Mapping[str, str]) -> Tokenizer:
        """The tokenizer ``state()`` described (e.g. read back from a cache file)."""
        return cls(tokenizers.Tokenizer.from_str(state["tokenizer"]), **json.loads(state["tokenizer_config"]))

    def save_pretrained(self, directory: str | Path) -> list[Path]:
        """Write this tokenizer as a transformers tokenizer directory (created if missing; its
        files replaced), which ``AutoTokenizer.from_pretrained`` and ``from_file`` read back:
        ``tokenizer.json`` (the backend, BOS/EOS insertion included) and ``tokenizer_config.json``
        (``PreTrainedTokenizerFast``, the BOS and EOS tokens, the chat template). transformers
        takes one EOS token: the first of ``eos_tokens`` (the others, end-of-turn tokens, are
        generation settings). Returns the files written."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_tokens[0] if self.eos_tokens else None,
            "chat_template": self.chat_template,
        }
        config = {key: value for key, value in config.items() if value is not None}
        files = {"tokenizer.json": self.backend.to_str(), "tokenizer_config.json": json.dumps(config, indent=2)}
        for name, text in files.items():
            (directory / name).write_text(text, encoding="utf-8")
        return [directory / name for name in files]

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_ids(self) -> list[int]:
        return [self.backend.token_to_id(t) for t in self.eos_tokens]

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; ``add_special_tokens`` adds BOS/EOS if the tokenizer is set to. Special
        tokens written in ``text`` (e.g. ``<|im_start|>``) always become their single ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @cached_property
    def _compiled_template(self):
        if self.chat_template is None:
            raise ValueError(
                f"{self.source} has no chat template (e.g. a base model); format the prompt yourself "
                "or load a tokenizer whose metadata / tokenizer_config.json has one"
            )
        return _template_environment().from_string(self.chat_template)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``); encode it
        with ``add_special_tokens=False``, since the template writes any BOS itself."""
        return self._compiled_template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_tokens[0] if self.eos_tokens else "",
            **kwargs,
        )
