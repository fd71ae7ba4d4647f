#!/usr/bin/env python
"""Page retrieval (``jaxkv.layers.retrieval``) against the full cache: decode tok/s at long contexts
and the K/V bytes a decode step reads (issue 42, deliverable 6).

    .venv/bin/python scripts/bench_retrieval.py --contexts 4096                       # this machine
    python scripts/bench_retrieval.py --contexts 4096 16384 --repeats 3               # on a GPU
    .venv/bin/python scripts/bench_retrieval.py --contexts 16384 --prefill-chunk 2048  # 16k here

Model: a Llama with SmolLM2-135M's shapes and random weights (``bench_offload.model_for``; what is
measured is the attention's reads, so the weights need not be real), a prompt of ``context`` random
tokens, ``--new-tokens`` greedy tokens; tok/s over the decode loop only (compile and prefill apart),
the median of ``--repeats`` runs. Caches: the static full cache, and retrieval of ``--budget`` tokens
with Quest's min/max bound over sequential pages of each of ``--page-sizes`` (16, Quest's, and 4,
the grid's best) and centroids over clustered pages of the first size; ``--offload``: each also
with its K/V in host memory (on a CPU both memories are the same RAM: only the copies' overhead
shows). A step's K/V reads are computed: the full cache's K/V, or the budget's K/V and every
page's summary, per K/V head and layer. ``--attention-only``: instead of the model, one compiled
decode step of attention alone over every layer's cache (a scan over the stacked layers,
SmolLM2's heads, random K/V), the median of ``--steps`` steps: what retrieval changes, without the
weights' reads.
"""

from __future__ import annotations

import argparse

from bench_offload import decode_rate, model_for


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument(
        "--page-sizes", type=int, nargs="+", default=[16, 4],
        help="Quest's minmax over sequential pages of each size; the clustered centroid at the first",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--attention-only", action="store_true", help="time the attention step alone")
    parser.add_argument(
        "--offload", action="store_true",
        help="each cache also with its K/V in host memory (retrieval: the chosen pages cross; full: each layer)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--prefill-chunk", type=int, default=0,
        help="prefill the prompt in updates of this many tokens (0: one update; a 16k-token update of the full "
        "cache does not fit 24 GiB on this machine)",
    )  # fmt: skip
    return parser.parse_args(argv)


def step_bytes(context: int, spec, layers: int, dtype_bytes: int) -> int:
    """K/V bytes one decode step reads per row: 3 K/V heads of 64 per layer (SmolLM2's shapes)."""
    per_token = 3 * 64 * dtype_bytes * layers
    if spec is None:
        return 2 * context * per_token
    rows = 2 if spec.summary == "minmax" else 1
    return 2 * spec.budget * per_token + rows * (-(-context // spec.page_size)) * per_token


def chunked_decode_rate(model, prompts, args, **options) -> float:
    """``decode_rate`` with the prompts but their last token prefilled ``args.prefill_chunk`` tokens
    per update (``prefill_prefix``'s ``chunk``), the last token fed to the timed ``generate`` call:
    median decode tok/s over ``args.repeats`` runs."""
    import statistics

    from jaxkv.decoding.generate import generate, prefill_prefix

    rates = []
    for _ in range(args.repeats):
        cache = prefill_prefix(model, [prompt[:-1] for prompt in prompts], chunk=args.prefill_chunk, **options)
        result = generate(model, [prompt[-1:] for prompt in prompts], max_new_tokens=args.new_tokens, cache=cache)
        rates.append(len(prompts) * (args.new_tokens - 1) / result.decode_seconds)
    return statistics.median(rates)


def attention_rate(context: int, spec, args, offload: bool) -> float:
    """Steps per second of one compiled decode step of attention alone over ``args.layers`` layers
    holding ``context`` random tokens (median of ``args.steps``, the first three apart)."""
    import functools
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv import Cache
    from jaxkv.attention import cached_attention

    heads, group, dim = 3, 3, 64
    dtype = jnp.dtype(args.dtype)
    cache = Cache.from_layer_types(
        ["full_attention"] * args.layers, batch_size=args.batch, num_kv_heads=heads, head_dim=dim, dtype=dtype,
        max_length=context + args.steps, retrieval=spec, stacked=True, offload=offload or None,
    )  # fmt: skip
    keys = jax.random.normal(jax.random.key(0), (args.batch, heads, context, dim), dtype)
    positions = cache.next_positions(context)
    for layer in range(args.layers):
        cache, _ = cache.update(layer, keys, keys, positions)
    query = jax.random.normal(jax.random.key(1), (args.batch, heads * group, 1, dim), dtype)
    new = jax.random.normal(jax.random.key(2), (args.batch, heads, 1, dim), dtype)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, positions):
        def layer(cache, index):
            cache, out = cached_attention(cache, index, query, new, new, positions)
            return cache, jnp.sum(out)

        return jax.lax.scan(layer, cache, jnp.arange(args.layers))

    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        cache, outs = step(cache, cache.next_positions(1))
        jax.block_until_ready(outs)
        times.append(time.perf_counter() - start)
    return 1.0 / float(np.median(times[3:]))


def main(argv=None) -> int:
    import jax
    import numpy as np

    from jaxkv.retrieval import RetrievalSpec

    args = parse(argv)
    specs = {"full": None}
    for size in args.page_sizes:
        specs[f"retrieval minmax, sequential pages of {size}"] = RetrievalSpec(args.budget, size)
    specs[f"retrieval centroid, clustered pages of {args.page_sizes[0]}"] = RetrievalSpec(
        args.budget, args.page_sizes[0], summary="centroid", pages="clustered"
    )
    places = (False, True) if args.offload else (False,)
    caches = {(f"{name}, host memory" if host else name, host): spec for name, spec in specs.items() for host in places}
    dtype_bytes = np.dtype(args.dtype).itemsize
    what = (
        f"attention alone, median of {args.steps} steps"
        if args.attention_only
        else (f"{args.new_tokens} new tokens, median of {args.repeats}")
    )
    print(f"{jax.devices()[0]}, SmolLM2-135M shapes ({args.layers} layers), {args.dtype}, batch {args.batch}, {what}")
    rate_name = "attention steps/s x rows" if args.attention_only else "decode tok/s"
    print(f"| context | cache | {rate_name} | ms/step | K/V MiB read per step and row | vs full |")
    print("|---:|---|---:|---:|---:|---:|")
    for context in args.contexts:
        args.context = context
        model = None if args.attention_only else model_for(args)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, args.vocab, size=context).tolist() for _ in range(args.batch)]
        base = None
        for (name, host), spec in caches.items():
            options = {"max_length": context + args.new_tokens}
            if spec is not None:
                options["retrieval"] = spec
            if host:
                options["offload"] = True
            if args.attention_only:
                rate = args.batch * attention_rate(context, spec, args, host)
            elif args.prefill_chunk:
                rate = chunked_decode_rate(model, prompts, args, **options)
            else:
                rate, _ = decode_rate(model, prompts, args, **options)
            base = base or rate
            mib = step_bytes(context, spec, args.layers, dtype_bytes) / 2**20
            print(
                f"| {context} | {name} | {rate:.1f} | {1e3 * args.batch / rate:.1f} | {mib:.1f} | {rate / base:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
