"""guidellm 0.8.1, a load-testing tool for OpenAI-compatible servers, against ``jaxkv serve``
on loopback: a bounded benchmark (concurrent streams, a fixed number of requests) finishes
with zero errors, and the server completed every request it sent.

guidellm's report can leave out the request whose completion ends the run: its coordinator
stops reading updates once a poll of the update queue times out after shutdown was signalled,
and the callback that signals shutdown runs before the last update is queued (seen once in
CI, 7 of 8 reported, none errored). The exact count is therefore taken from the server's
``/metrics`` (``jaxkv_requests_total{outcome=...}``), and guidellm's report is held to no
errors, no incomplete requests, all but at most that one, and exactly ``OUTPUT_TOKENS`` each.

guidellm lives in its own virtual environment, not in the test extra: it pins ``click~=8.4``
(the project's environment has a newer click) and brings sanic, faker, datasets and its own
torch requirement, none of which the project's environment should change. ``bash
scripts/setup.sh test`` creates that environment once (about 1.5 GB, 2 minutes) under the jaxkv
cache directory (``~/.cache/jaxkv/guidellm-0.8.1``, or under ``$XDG_CACHE_HOME``), so the timed
test run finds it ready; the test creates it where it is missing. guidellm
runs offline: its tokenizer is a directory that ``jaxkv tokenizer`` writes from the embedded
SmolLM2 GGUF's tokenizer (``tokenizer.json`` and ``tokenizer_config.json``, which transformers'
``AutoTokenizer`` reads), as a user would.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from jaxkv.models.weight_cache import cache_dir
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL

pytestmark = [pytest.mark.server, pytest.mark.slow]

GUIDELLM = "guidellm==0.8.1"
TORCH = "torch==2.13.0"  # the parity extra's pin: its CPU wheel where the machine has one, not a CUDA build
REQUESTS, STREAMS, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 4, 64, 16
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def guidellm_python() -> Path:
    """The Python of guidellm's environment, created on first use: built beside its final place
    and renamed into it, so a half-built environment is never taken for a ready one."""
    home = cache_dir() / GUIDELLM.replace("==", "-")
    if not home.is_dir():
        building = home.with_name(f"{home.name}.building-{os.getpid()}")
        subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)
        install = [str(building / "bin" / "python"), "-m", "pip", "install", "-q", GUIDELLM, TORCH]
        subprocess.run(install, check=True, timeout=1800)
        try:
            building.rename(home)
        except OSError:  # another run finished first
            shutil.rmtree(building)
    return home / "bin" / "python"


def tokenizer_dir(path: Path) -> Path:
    """``path``, into which ``jaxkv tokenizer`` (the installed command) wrote ``MODEL``'s tokenizer."""
    cli = Path(sys.executable).with_name("jaxkv")
    command = [str(cli), "tokenizer", "--model", MODEL, "--out", str(path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return path


def guidellm_command(python: Path, url: str, tokenizer: Path, out: Path, *, streams: int, requests: int,
                     prompt_tokens: int, output_tokens: int) -> list[str]:  # fmt: skip
    """A chat-completions benchmark: ``streams`` concurrent streams, ``requests`` in all, synthetic
    prompts of ``prompt_tokens`` and outputs of exactly ``output_tokens`` (guidellm sends ignore_eos)."""
    return [
        str(python), "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={url},model={MODEL}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--profile", f"kind=concurrent,streams={streams}",
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip


def request_outcomes(url: str) -> dict[str, float]:
    """The server's ``jaxkv_requests_total`` by outcome label (outcomes never seen are absent)."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    (family,) = (f for f in families if f.name == "jaxkv_requests")
    return {s.labels["outcome"]: s.value for s in family.samples if s.name == "jaxkv_requests_total"}


def test_a_bounded_guidellm_benchmark_has_no_errors(server, tmp_path):
    python = guidellm_python()
    tokenizer = tokenizer_dir(tmp_path / "tokenizer")
    out = tmp_path / "benchmarks.json"
    command = guidellm_command(python, server[1], tokenizer, out, streams=STREAMS, requests=REQUESTS,
                               prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS)  # fmt: skip
    env = os.environ | OFFLINE | {"GUIDELLM__DEFAULT_RESULTS_DIR": str(tmp_path)}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] == 0, totals
    assert REQUESTS - 1 <= totals["successful"] == totals["total"] <= REQUESTS, totals
    output = benchmark["metrics"]["output_token_count"]["successful"]
    assert output["total_sum"] == totals["successful"] * OUTPUT_TOKENS, output
    assert request_outcomes(server[1]) == {"completed": REQUESTS}
