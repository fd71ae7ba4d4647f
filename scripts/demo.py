"""Run a toy decoder through a jaxkv cache: ragged prefill, then a compiled decode loop.

    python scripts/demo.py [--config configs/toy.yaml] [--full-attention static|dynamic]

Builds a cache from the toy config's layer types (full, sliding window, chunked), prefills
two prompts of different lengths in one batch, decodes greedily in one ``lax.scan`` with
the cache in the carry (donated), checks every step's logits against running the model
over the whole sequence without a cache, and prints the cache and the memory tables.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import PositiveInt

from jaxkv.config import CacheConfig, Strict, load_config
from jaxkv.cache import Cache
from jaxkv.memory import formula_table, model_table
from jaxkv.models.architectures import DEFAULT_MODELS
from jaxkv.models.toy import ToyConfig, ToyDecoder


class DemoConfig(Strict):
    model: ToyConfig = ToyConfig()
    cache: CacheConfig = CacheConfig(max_length=64)
    new_tokens: PositiveInt = 24


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def prefill(graphdef, state, cache, tokens, positions):
    logits, cache = nnx.merge(graphdef, state)(tokens, positions, cache)
    last = jnp.max(jnp.arange(tokens.shape[1]) * (positions >= 0), axis=1)
    return jnp.argmax(logits[jnp.arange(tokens.shape[0]), last], axis=-1), cache


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=2)
def decode(graphdef, state, cache, first_token, num_steps):
    model = nnx.merge(graphdef, state)

    def step(carry, _):
        token, cache = carry
        logits, cache = model(token[:, None], cache.lengths[:, None], cache)
        return (jnp.argmax(logits[:, -1], axis=-1), cache), (token, logits[:, -1])

    (_, cache), (tokens, logits) = jax.lax.scan(step, (first_token, cache), length=num_steps)
    return tokens.T, logits.transpose(1, 0, 2), cache


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/toy.yaml", help="YAML file with model, cache, new_tokens")
    parser.add_argument("--full-attention", choices=["static", "dynamic"], help="override cache.full_attention")
    args = parser.parse_args()
    demo = load_config(args.config, DemoConfig)
    cache_config = demo.cache.model_copy(update={"full_attention": args.full_attention or demo.cache.full_attention})
    new_tokens = demo.new_tokens

    config = demo.model
    model = ToyDecoder(config, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    prompts = [[5, 17, 3, 42, 8, 8, 61, 2, 9, 33, 14], [7, 7, 19, 4]]
    width = max(map(len, prompts))
    tokens = jnp.array([p + [0] * (width - len(p)) for p in prompts])
    cache = Cache.from_config(config, len(prompts), **cache_config.model_dump())
    positions = cache.next_positions(width, num_new=[len(p) for p in prompts])
    cache = cache.reserve(width + new_tokens)

    start = time.perf_counter()
    first, cache = prefill(graphdef, state, cache, tokens, positions)
    generated, step_logits, cache = decode(graphdef, state, cache, first, new_tokens)
    generated.block_until_ready()
    print(f"prefill + {new_tokens} decode steps (compile included): {time.perf_counter() - start:.2f} s\n")

    worst = 0.0
    for row, prompt in enumerate(prompts):
        sequence = jnp.array([prompt + generated[row].tolist()])
        full_logits, _ = model(sequence, jnp.arange(sequence.shape[1])[None])
        expected = full_logits[0, len(prompt) : len(prompt) + new_tokens]
        worst = max(worst, float(jnp.max(jnp.abs(expected - step_logits[row]))))
        print(f"row {row}: prompt {prompt} -> {np.asarray(generated[row]).tolist()}")
    print(f"\nmax |cached - uncached| logits over all decode steps: {worst:.2e}\n")
    print(cache, "\n")
    print(formula_table(), "\n")
    print("K/V bytes per sequence, bfloat16, static full attention:\n")
    print(model_table(DEFAULT_MODELS))
    if worst > 1e-4:
        raise SystemExit("cached decoding disagrees with the uncached model")


if __name__ == "__main__":
    main()
