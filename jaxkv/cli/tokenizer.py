"""``jaxkv tokenizer``: a model's tokenizer as a transformers tokenizer directory.

    jaxkv tokenizer --model smollm2 --out /tmp/smollm2-tokenizer

Tools that load their tokenizer with transformers' ``AutoTokenizer`` (guidellm, to count a
benchmark's tokens) need a directory of ``tokenizer.json`` and ``tokenizer_config.json``; a
GGUF has neither. This writes both from the model's tokenizer (a GGUF's metadata, or a
checkpoint directory's files; ``Tokenizer.save_pretrained``), so such a tool runs offline on
the tokenizer the server uses.
"""

from __future__ import annotations

from pathlib import Path

MODEL_HELP = "embedded default name (smollm2, gemma3), a checkpoint directory or a .gguf file (default smollm2)"


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "tokenizer",
        help="write a model's tokenizer as a transformers tokenizer directory (for AutoTokenizer, e.g. guidellm)",
        description="Write tokenizer.json and tokenizer_config.json (PreTrainedTokenizerFast, the BOS/EOS tokens, "
        "the chat template) for --model into --out, which transformers' AutoTokenizer.from_pretrained loads.",
    )
    parser.add_argument("--model", default="smollm2", help=MODEL_HELP)
    parser.add_argument(
        "--out", type=Path, required=True, metavar="DIR",
        help="the directory to write (created if missing; tokenizer files already there are replaced)",
    )  # fmt: skip


def run(args) -> int:
    """Write ``args.model``'s tokenizer into ``args.out``; says which files it wrote."""
    for path in write_tokenizer(args.model, args.out):
        print(path)
    return 0


def write_tokenizer(model: str, out: Path) -> list[Path]:
    """``model``'s tokenizer written into the directory ``out`` (``Tokenizer.save_pretrained``);
    returns the files written. Errors name the argument at fault (``--model``, ``--out``)."""
    from jaxkv.models.load import Pretrained

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    try:
        tokenizer = Pretrained(model).tokenizer(required=True)
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"--model {model}: {error}") from None
    try:
        return tokenizer.save_pretrained(out)
    except OSError as error:
        raise ValueError(f"--out {out}: cannot write the tokenizer there: {error.strerror or error}") from None
