"""``python scripts/vllm_env.py [--model NAME]``: vLLM's venv and the float32 checkpoint folder that
``jaxkv bench serving --systems ... vllm`` and ``scripts/load_test.py --server vllm`` use; the
logic lives in ``jaxkv.bench.vllm_env`` (see its docstring), so an installed jaxkv makes them too."""

import sys

from jaxkv.bench.vllm_env import main

if __name__ == "__main__":
    sys.exit(main())
