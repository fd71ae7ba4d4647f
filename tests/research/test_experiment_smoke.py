"""``jaxkv experiment`` on the smoke grid end to end (SmolLM2: results, summary, plot, resuming). Its
own file, so that it compiles with full optimization (``OPTIMIZED_FILES`` in tests/conftest.py: real
weights, many tokens); the rest of the experiment runner's tests are in test_experiment.py.
"""

import csv
import json
from pathlib import Path

import numpy as np

from jaxkv.cli.main import main

EXPERIMENTS = Path(__file__).resolve().parents[2] / "configs" / "experiments"


def test_smoke_grid_end_to_end_and_resumes(capsys, tmp_path, monkeypatch):
    """The CI grid: results.jsonl (one line per cell), summary.csv and the PNG; K/V bytes follow the
    budgets; the executables of a cache setting are dropped when the next setting's cells start (a
    process keeping every cell's ran out of memory mappings); a second run finds every cell done
    and loads no model."""
    import jax

    clears = []
    clear_caches = jax.clear_caches
    monkeypatch.setattr(jax, "clear_caches", lambda: clears.append(1) or clear_caches())
    assert main(["experiment", str(EXPERIMENTS / "smoke.yaml"), "--output-dir", str(tmp_path)]) == 0
    assert len(clears) == 4  # one model, four cache settings
    out = tmp_path / "smoke"
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 12
    cell = {(x["task"], x["cache"], x["budget"]): x for x in lines}
    for task in ("passkey", "perplexity"):
        full = cell[task, "full", 1.0]["kv_bytes"]
        assert cell[task, "int8", 1.0]["kv_bytes"] < full
        for policy in ("streaming_llm", "snapkv"):
            assert cell[task, policy, 0.25]["kv_bytes"] < cell[task, policy, 0.5]["kv_bytes"] < full
    assert cell["passkey", "full", 1.0]["value"] == 1.0  # both depths found with the full cache
    assert cell["passkey", "full", 1.0]["metrics"]["predictions"] == cell["passkey", "full", 1.0]["metrics"]["answers"]
    full_ppl = cell["perplexity", "full", 1.0]["value"]
    assert 5 < full_ppl < 100
    np.testing.assert_allclose(cell["perplexity", "int8", 1.0]["value"], full_ppl, rtol=0.01)
    with (out / "summary.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 12 and {r["metric"] for r in rows} == {"accuracy", "perplexity"}
    assert all(float(r["kv_vs_full"]) <= 1.0 for r in rows)
    assert (out / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()

    import jaxkv.models.load

    def no_load(*args, **kwargs):
        raise AssertionError("a finished grid loads no model")

    monkeypatch.setattr(jaxkv.models.load, "load_pretrained", no_load)
    assert main(["experiment", str(EXPERIMENTS / "smoke.yaml"), "--output-dir", str(tmp_path)]) == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == 12
    assert main(["experiment", str(EXPERIMENTS / "smoke.yaml"), "--dry-run", "--output-dir", str(tmp_path)]) == 0
    assert "12 cells, 0 to run" in capsys.readouterr().out
