"""``scripts/load_test.py``: a quick run end to end (it starts ``jaxkv serve`` on loopback, streams
through the openai client, then runs the engine in-process) and its refusal of a remote URL."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "load_test.py"


def run_script(*options: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *options], check=False, capture_output=True, text=True, timeout=timeout
    )


def test_quick_run_completes_every_request_over_http_and_in_process(tmp_path):
    """``--quick`` with 32 tokens a step: 3 step shapes to compile in the server and in-process
    instead of 4 (a prompt of up to 64 tokens prefills in two chunks)."""
    out = tmp_path / "load.json"
    proc = run_script("--quick", "--max-num-batched-tokens", "32", "--out", str(out), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(out.read_text())
    rows = {row["system"]: row for row in report["rows"]}
    assert set(rows) == {"http", "engine"}
    for row in rows.values():
        assert row["completed"] == row["planned"] == 8 and row["errors"] == 0, row["error_messages"]
        assert 8 <= row["output_tokens"] <= 8 * 8 and row["output_tok_s"] > 0
        assert row["ttft_p50_s"] <= row["ttft_p99_s"] and row["itl_p50_ms"] <= row["itl_p99_ms"]
    # Both runs are greedy over the same prompts: the same tokens, HTTP or not.
    assert rows["http"]["output_tokens"] == rows["engine"]["output_tokens"]
    assert report["overhead"]["value"] == 1 - rows["http"]["output_tok_s"] / rows["engine"]["output_tok_s"]
    assert report["server_exit"] == 0
    assert "| jaxkv serve (HTTP, openai client) | 8/8 | 0 |" in proc.stdout
    assert "| jaxkv engine (in-process) | 8/8 | 0 |" in proc.stdout


def test_a_url_off_this_machine_is_refused():
    proc = run_script("--url", "http://192.0.2.1:8000", timeout=120)
    assert proc.returncode == 2
    assert "loopback only" in proc.stderr and "http://127.0.0.1:PORT" in proc.stderr
