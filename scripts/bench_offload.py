#!/usr/bin/env python
"""Offloaded K/V (``jaxkv.offload``) against a resident cache: decode tok/s at a long context,
the bandwidth of one prefetched layer's copy each way, and of the serving engine's page copies
to and from its host tier.

    python scripts/bench_offload.py --device gpu                     # SmolLM2-135M's shapes, 8k context
    python scripts/bench_offload.py --device cpu --layers 4 --vocab 512 --context 256 --new-tokens 8   # smoke

Model: a Llama with SmolLM2-135M's shapes (30 layers, 9 query and 3 K/V heads of 64, hidden
576) and random weights; ``--layers``, ``--vocab`` shrink it. What is measured is K/V traffic,
so the weights need not be real; the offloaded run must give the resident run's tokens.

* decode: ``generate`` over a prompt of ``--context`` random tokens, ``--new-tokens`` greedy
  tokens per row, ``--batch`` rows; tok/s over the decode loop only (compile and prefill are
  apart), the median of ``--repeats`` runs, resident and ``offload=True``.
* layer copy: a compiled scan over the cache's offloaded stack that fetches each layer's K/V
  to the device (``jaxkv.offload.fetch``, the copy a prefetch makes), or writes a device window
  back into each entry (``store``); bytes of one layer's K/V times layers over the median time.
* page copies: the engine's host-tier copies (``ModelRunner.move_pages``) of a batch of
  ``--copy-pages`` pages of the model's full-attention pool: read into host memory (a demotion
  or a swap-out) and written back (a promotion or a swap-in); bytes over the median time, the
  first run of each (its compile) apart.

On the CPU backend host and device memory are the same RAM: the copies are memory copies and
the figures say what a step costs there, not what a PCIe or NVLink link gives; ``--device gpu``
measures that.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--context", type=int, default=8192, help="prompt tokens (the decode's context)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copy-pages", type=int, default=64, help="pages per batch of the engine's host-tier copies")
    parser.add_argument("--json", help="write the results here too")
    return parser.parse_args(argv)


def model_for(args):
    import jax.numpy as jnp

    from jaxkv.models.llama import Llama, LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2 * (args.context + args.new_tokens),
        tie_word_embeddings=True,
    )  # fmt: skip
    return Llama(config, dtype=jnp.dtype(args.dtype))


def decode_rate(model, prompts, args, **options) -> tuple[float, list]:
    """Median decode tok/s over ``args.repeats`` runs, and the tokens of the last."""
    from jaxkv.decoding.generate import generate

    rates, result = [], None
    for _ in range(args.repeats):
        result = generate(model, prompts, max_new_tokens=args.new_tokens, **options)
        rates.append(len(prompts) * (args.new_tokens - 1) / result.decode_seconds)
    return statistics.median(rates), result.tokens.tolist()


def copy_bandwidth(cache, repeats: int) -> dict:
    """GB/s of fetching every layer of the first offloaded stack to the device, and of writing
    a device window back into every entry, in one compiled scan each."""
    import jax
    import jax.numpy as jnp

    from jaxkv.cache import first_entry_shapes
    from jaxkv.offload import fetch, kv_leaves, store

    stack = cache.groups[cache.offloaded[0]]
    host = kv_leaves(first_entry_shapes(stack).logical_axes())
    count = jax.tree.leaves(stack)[0].shape[0]
    layer_bytes = sum(leaf.nbytes // count for leaf, kv in zip(jax.tree.leaves(stack), jax.tree.leaves(host)) if kv)

    @jax.jit
    def fetch_all(stack):
        def one(total, i):  # the sum keeps every fetched byte live
            window = fetch(stack, i, host)
            leaves = [leaf for leaf, kv in zip(jax.tree.leaves(window), jax.tree.leaves(host)) if kv]
            return total + sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in leaves), None

        return jax.lax.scan(one, jnp.float32(0), jnp.arange(count))[0]

    @functools.partial(jax.jit, donate_argnums=0)  # written in place, as a decode step's stack is
    def store_all(stack, window):
        return jax.lax.scan(lambda s, i: (store(s, i, window, host), None), stack, jnp.arange(count))[0]

    window = jax.jit(lambda stack: fetch(stack, 0, host))(stack)  # one layer on the device
    written = [stack]  # the fetches run first; then the stores take the stack over, one run after another

    def store_run():
        written[0] = store_all(written[0], window)
        return written[0]

    runs = {"host_to_device": lambda: fetch_all(stack), "device_to_host": store_run}
    result = {"layer_bytes": layer_bytes, "layers": count}
    for name, run in runs.items():
        jax.block_until_ready(run())  # compile
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(run())
            times.append(time.perf_counter() - start)
        result[f"{name}_gb_per_s"] = layer_bytes * count / statistics.median(times) / 1e9
    return result


def page_copy_bandwidth(model, args) -> dict:
    """GB/s of the engine's host-tier copies of ``args.copy_pages`` pages each way (16-token pages)."""
    import jax

    from jaxkv.serving import Engine
    from jaxkv.serving.host_tier import HostPage
    from jaxkv.serving.kv_manager import PageMoves

    probe = Engine(model, kv_memory="1MiB", max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64)
    page_bytes = probe.kv.pools[0].page_bytes
    engine = Engine(model, kv_memory=(args.copy_pages + 2) * page_bytes, max_num_seqs=1, max_num_batched_tokens=16,
                    max_model_len=64, host_kv_memory=2 * args.copy_pages * page_bytes)  # fmt: skip
    pool, pages = engine.kv.pools[0].name, range(1, args.copy_pages + 1)  # page 0 is the null page
    host_pages = [HostPage(page_bytes) for _ in pages]
    moves = {
        "to_host": lambda: PageMoves(out={pool: list(zip(pages, host_pages))}),
        "to_device": lambda: PageMoves(into={pool: list(zip(host_pages, pages))}),
    }
    result = {"copy_pages": args.copy_pages, "page_bytes": page_bytes}
    for name, batch in moves.items():
        times = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            engine.runner.move_pages(batch())
            jax.block_until_ready(engine.runner.cache)
            times.append(time.perf_counter() - start)
        result[f"pages_{name}_gb_per_s"] = args.copy_pages * page_bytes / statistics.median(times[1:]) / 1e9
    return result


def main(argv=None) -> int:
    args = parse(argv)
    import jax

    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() != "gpu":
        print(f"bench_offload: --device gpu but JAX's backend is {jax.default_backend()}", file=sys.stderr)
        return 2
    import numpy as np

    model = model_for(args)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, args.vocab, size=(args.batch, args.context)).tolist()
    resident, resident_tokens = decode_rate(model, prompts, args)
    offloaded, offloaded_tokens = decode_rate(model, prompts, args, offload=True)
    cache = model.init_cache(args.batch, args.context + args.new_tokens, offload=True)
    report = {
        "device": str(jax.devices()[0]), "context": args.context, "batch": args.batch, "layers": args.layers,
        "dtype": args.dtype, "resident_tok_per_s": resident, "offloaded_tok_per_s": offloaded,
        "offloaded_over_resident": offloaded / resident, "same_tokens": offloaded_tokens == resident_tokens,
        "device_bytes": sum(cache.device_bytes().values()), "host_bytes": sum(cache.host_bytes().values()),
        **copy_bandwidth(cache, args.repeats), **page_copy_bandwidth(model, args),
    }  # fmt: skip
    for key, value in report.items():
        print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
