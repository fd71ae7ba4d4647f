"""Print the cache types table (memory formulas) and K/V bytes of real models at 4k and 32k.

    python scripts/memory_table.py
"""

import jax.numpy as jnp

from jaxkv.memory import SHARED_KV_ROW, formula_table, model_table
from jaxkv.models.architectures import DEFAULT_MODELS

def main():
    print(formula_table())
    print(SHARED_KV_ROW)
    print("\nB batch, S tokens, S_max preallocated, W window, C chunk, R rollback slots, H_kv K/V heads, D head dim; "
          "K conv width, C_conv conv channels, ΣS recurrent state elements per row (float32).")
    for dtype in (jnp.bfloat16, jnp.float32):
        print(f"\nK/V cache per sequence, {jnp.dtype(dtype).name}, batch 1, static full-attention layers:\n")
        print(model_table(DEFAULT_MODELS, dtype=dtype))


if __name__ == "__main__":
    main()
