"""``jaxkv generate``: text from a real model through a jaxkv cache, with timings.

    jaxkv generate --model smollm2 --prompt "What is a KV cache?" --max-new-tokens 64
    jaxkv generate --config configs/smollm2.yaml --stream
    jaxkv bench --batch 1 8 --new-tokens 256          (scripts/bench_decode.py)
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import NonNegativeFloat, NonNegativeInt, PositiveInt

from jaxkv.config import CacheConfig, Strict, load_config


class GenerateConfig(Strict):
    """What ``jaxkv generate`` runs; a YAML file under configs/ sets any of these."""

    model: str = "smollm2"
    prompt: str = "What is a KV cache, in two sentences?"
    chat: bool = True
    max_new_tokens: PositiveInt = 64
    dtype: Literal["float32", "bfloat16"] = "float32"
    cache: CacheConfig = CacheConfig()
    temperature: NonNegativeFloat = 0.0
    top_k: NonNegativeInt = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0


def _generate_parser(sub) -> None:
    parser = sub.add_parser("generate", help="generate text with a model")
    parser.add_argument("--config", type=Path, help="YAML file (configs/*.yaml); flags below override it")
    parser.add_argument("--model", help="embedded default name (smollm2, gemma3), a checkpoint directory or a .gguf file")
    parser.add_argument("--prompt")
    parser.add_argument("--no-chat", dest="chat", action="store_false", default=None, help="no chat template")
    parser.add_argument("--cache", choices=["static", "dynamic"], help="full-attention cache kind")
    parser.add_argument("--max-length", type=int, help="cache capacity in tokens (default: prompt + new, bucketed)")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stream", action="store_true", help="print tokens as they are produced")


def resolve_config(args) -> GenerateConfig:
    """The YAML config (if any) with the command-line flags on top, validated as a whole."""
    merged = (load_config(args.config, GenerateConfig) if args.config else GenerateConfig()).model_dump()
    for key in ("model", "prompt", "chat", "max_new_tokens", "dtype", "temperature", "top_k", "top_p", "min_p", "seed"):
        if getattr(args, key) is not None:
            merged[key] = getattr(args, key)
    for key, flag in (("full_attention", args.cache), ("max_length", args.max_length)):
        if flag is not None:
            merged["cache"][key] = flag
    return GenerateConfig.model_validate(merged)


def run_generate(args) -> int:
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.generate import Sampling, generate
    from models.load import load_pretrained

    config = resolve_config(args)
    sampling = Sampling(config.temperature, config.top_k, config.top_p, config.min_p)
    start = time.perf_counter()
    model, tokenizer = load_pretrained(config.model, dtype=jnp.dtype(config.dtype))
    load_seconds = time.perf_counter() - start
    text = (
        tokenizer.apply_chat_template([{"role": "user", "content": config.prompt}])
        if config.chat
        else config.prompt
    )
    prompt = tokenizer.encode(text)

    streamed: list[int] = []
    printed = [0]

    def stream(tokens: np.ndarray) -> None:
        if tokens[0] >= 0 and tokens[0] not in tokenizer.eos_token_ids:
            streamed.append(int(tokens[0]))
            text_so_far = tokenizer.decode(streamed)
            sys.stdout.write(text_so_far[printed[0] :])
            sys.stdout.flush()
            printed[0] = len(text_so_far)

    cache = config.cache
    result = generate(
        model,
        [prompt],
        max_new_tokens=config.max_new_tokens,
        stop_tokens=tokenizer.eos_token_ids,
        sampling=sampling,
        seed=config.seed,
        cache_kind=cache.full_attention,
        max_length=cache.max_length,
        rollback_slots=cache.rollback_slots,
        stream=stream if args.stream else None,
    )
    if args.stream:
        print()
    else:
        print(tokenizer.decode(result.row(0)))
    new = int(result.num_generated[0])
    print(
        f"\n[{config.model}] prompt {len(prompt)} tok, {new} new ({result.finish[0].name.lower()}); "
        f"prefill {len(prompt) / result.prefill_seconds:.1f} tok/s, decode {max(new - 1, 1) / result.decode_seconds:.1f} tok/s; "
        f"compile {result.compile_seconds:.1f} s, load {load_seconds:.1f} s; cache {result.cache_bytes / 2**20:.1f} MiB",
        file=sys.stderr,
    )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxkv", description="Functional KV caches for JAX models")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    sub.add_parser("bench", help="decode benchmark against transformers (scripts/bench_decode.py ARGS)")
    args, rest = parser.parse_known_args(argv)
    if args.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = [arg for arg in rest if arg != "--"]
    if args.command == "bench":  # the benchmark lives in the source checkout's scripts/
        script = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode.py"
        if not script.is_file():
            print(f"jaxkv: error: {script} not found; run bench from a source checkout", file=sys.stderr)
            return 2
        sys.argv = [str(script), *args.rest]
        runpy.run_path(str(script), run_name="__main__")
        return 0
    try:
        return run_generate(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"jaxkv: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
