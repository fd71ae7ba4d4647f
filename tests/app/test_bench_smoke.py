"""scripts/bench_decode.py still runs: parent + jaxkv workers (two runs each) on a tiny random Llama."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_decode.py"


def test_bench_decode_tiny_jaxkv(tmp_path):
    out = tmp_path / "bench"
    args = [
        "--model", "tiny-random", "--systems", "jaxkv-static", "jaxkv-unrolled", "--batch", "2",
        "--new-tokens", "3", "--prompt-tokens", "5", "--membw-mib", "8", "--repeat", "2", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| jaxkv | static | 2 |" in proc.stdout and "| jaxkv unrolled | static | 2 |" in proc.stdout
    report = json.loads(out.with_suffix(".json").read_text())
    scanned, unrolled = report["rows"]
    for row in (scanned, unrolled):
        assert "error" not in row, row
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["cache_bytes"] > 0
        assert row["tokens_head"] and row["rows_identical"]
        low, high = row["decode_tok_s_runs"]  # --repeat 2: two fresh workers, the row is the slower's
        assert low <= high and row["decode_tok_s"] == low
    assert scanned["tokens_head"] == unrolled["tokens_head"]  # same weights, same greedy tokens
    assert report["bandwidth_bound"]["tok_s_upper_bound_b1"] > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 0


def test_bench_decode_quantized_and_gpu_refusal(tmp_path):
    """``--quantized``: full precision and the chosen formats, each a row with decode and
    perplexity-window times over full precision's, and a target per ratio. ``--device gpu``
    without a GPU stops before any configuration runs, saying what is missing."""
    out = tmp_path / "bench"
    args = [
        "--model", "tiny-random", "--systems", "jaxkv-static", "--batch", "1", "--new-tokens", "3",
        "--prompt-tokens", "5", "--membw-mib", "8", "--quantized", "--quantized-formats", "fp8-e4m3", "int4-kivi",
        "--quantized-context", "256", "--quantized-new-tokens", "3", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "### Quantized K/V" in proc.stdout and "| fp8-e4m3 |" in proc.stdout
    rows = json.loads(out.with_suffix(".json").read_text())["quantized"]
    assert [r["name"] for r in rows] == ["full", "fp8-e4m3", "int4-kivi"]
    full, *quantized = rows
    for row in quantized:
        assert "error" not in row, row
        assert row["cache_bytes"] < full["cache_bytes"] and row["window_s"] > 0 and row["decode_vs_full"] > 0
        assert abs(row["perplexity"] - full["perplexity"]) < 0.05 * full["perplexity"]  # random weights: near-uniform
    assert "quantized fp8-e4m3 decode <= 1.5x full precision" in proc.stdout
    gpu = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny-random", "--device", "gpu", "--membw-mib", "8",
                          "--out", str(tmp_path / "gpu")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert gpu.returncode == 2 and "--device gpu, but JAX found no GPU" in gpu.stderr
