"""scripts/bench_decode.py still runs: parent + jaxkv workers on a tiny random Llama. One run
takes jaxkv static twice (``--repeat 2``), the other jaxkv unrolled once, then the quantized
K/V experiment; the two systems' greedy tokens are compared across the runs (same weights,
same prompt, same batch)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_decode.py"
TINY = ["--model", "tiny-random", "--batch", "2", "--new-tokens", "3", "--prompt-tokens", "5", "--membw-mib", "8"]


def bench_decode(out: Path, *options: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *TINY, *options, "--out", str(out)], check=False,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """jaxkv unrolled at batch 2, then ``--quantized``: full precision and two formats. Its
    stdout and JSON report."""
    out = tmp_path_factory.mktemp("bench") / "bench"
    proc = bench_decode(out, "--systems", "jaxkv-unrolled", "--quantized", "--quantized-formats", "fp8-e4m3",
                        "int4-kivi", "--quantized-context", "256", "--quantized-new-tokens", "3", timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.with_suffix(".json").read_text())


def test_bench_decode_tiny_jaxkv(tmp_path, quantized):
    out = tmp_path / "bench"
    proc = bench_decode(out, "--systems", "jaxkv-static", "--repeat", "2", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| jaxkv | static | 2 |" in proc.stdout and "| jaxkv unrolled | static | 2 |" in quantized[0]
    report = json.loads(out.with_suffix(".json").read_text())
    (scanned,), (unrolled,) = report["rows"], quantized[1]["rows"]
    for row in (scanned, unrolled):
        assert "error" not in row, row
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["cache_bytes"] > 0
        assert row["tokens_head"] and row["rows_identical"]
    low, high = scanned["decode_tok_s_runs"]  # --repeat 2: two fresh workers, the row is the slower's
    assert low <= high and scanned["decode_tok_s"] == low
    assert scanned["tokens_head"] == unrolled["tokens_head"]  # same weights, same greedy tokens
    assert report["bandwidth_bound"]["tok_s_upper_bound_b1"] > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 0


def test_bench_decode_quantized_and_gpu_refusal(tmp_path, quantized):
    """``--quantized``: full precision and the chosen formats, each a row with decode and
    perplexity-window times over full precision's, and a target per ratio. ``--device gpu``
    without a GPU stops before any configuration runs, saying what is missing."""
    stdout, report = quantized
    assert "### Quantized K/V" in stdout and "| fp8-e4m3 |" in stdout
    rows = report["quantized"]
    assert [r["name"] for r in rows] == ["full", "fp8-e4m3", "int4-kivi"]
    full, *quantized_rows = rows
    for row in quantized_rows:
        assert "error" not in row, row
        assert row["cache_bytes"] < full["cache_bytes"] and row["window_s"] > 0 and row["decode_vs_full"] > 0
        assert abs(row["perplexity"] - full["perplexity"]) < 0.05 * full["perplexity"]  # random weights: near-uniform
    assert "quantized fp8-e4m3 decode <= 1.5x full precision" in stdout
    gpu = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny-random", "--device", "gpu", "--membw-mib", "8",
                          "--out", str(tmp_path / "gpu")], check=False, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert gpu.returncode == 2 and "--device gpu, but JAX found no GPU" in gpu.stderr
