"""``jaxkv chat``: a multi-turn chat on stdin, each turn continuing the previous turn's cache.

    jaxkv chat --system "Be brief." --save-cache chat.safetensors   (one message per stdin line)
"""

from __future__ import annotations

import sys
from pathlib import Path

from jaxkv.cli.generate import NO_CACHE_HELP


def add_parser(sub) -> None:
    parser = sub.add_parser("chat", help="multi-turn chat on stdin; each turn continues the previous turn's cache")
    parser.add_argument("--model", default="smollm2", help="as for generate")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per reply")
    parser.add_argument("--max-length", type=int, default=2048, help="tokens the whole conversation may hold")
    parser.add_argument(
        "--full-attention", choices=["static", "dynamic"], default="static", help="storage of full-attention layers"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--no-cache", dest="weight_cache", action="store_false", help=NO_CACHE_HELP)
    parser.add_argument("--load-cache", type=Path, help="resume from a cache file (jaxkv.persist) made for this model")
    parser.add_argument("--save-cache", type=Path, help="write the conversation's cache here at the end")


def run(args) -> int:
    """One user message per stdin line; a reply feeds only the tokens the cache lacks."""
    import jax.numpy as jnp

    from jaxkv.decoding.session import Session
    from jaxkv.models.load import Pretrained
    from jaxkv.persist import load_cache, save_cache

    source = Pretrained(args.model, use_weight_cache=args.weight_cache)
    tokenizer = source.tokenizer(required=True)
    if tokenizer.chat_template is None:  # known before the slow weights load
        raise ValueError(f"{args.model} has no chat template, which chat needs; try jaxkv generate --no-chat")
    model = source.model(jnp.dtype(args.dtype))
    if args.load_cache:
        cache, tokens = load_cache(args.load_cache, model)
        if tokens is None:
            raise ValueError(f"{args.load_cache} stores no token ids; save it with save_cache(..., tokens=...)")
        session = Session(model, cache=cache, tokens=tokens[0])
    else:
        session = Session(model, max_length=args.max_length, full_attention=args.full_attention)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    for turn, line in enumerate(sys.stdin):
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        conversation = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        result = session.reply(conversation, max_new_tokens=args.max_new_tokens, stop_tokens=tokenizer.eos_token_ids)
        answer = tokenizer.decode([t for t in result.row(0) if t not in tokenizer.eos_token_ids])
        messages.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
        print(
            f"[turn {turn}] prefilled {session.fed_tokens} of {len(conversation)} conversation tokens (the rest "
            f"from the cache) in {result.prefill_seconds:.2f} s; {int(result.num_generated[0])} new "
            f"({result.finish[0].name.lower()}) in {result.decode_seconds:.2f} s",
            file=sys.stderr,
        )
    if args.save_cache:
        save_cache(args.save_cache, session.cache, model, tokens=[session.tokens])
        print(f"[chat] cache of {len(session.tokens)} tokens saved to {args.save_cache}", file=sys.stderr)
    return 0
