"""``jaxkv bench latent`` (jaxkv.bench.latent) at tiny sizes: a row per context and case with a
positive time, the bytes a step reads by the module's formulas (DSA's attention part flat in S
past index_topk, the latent's a fixed fraction of the full-head cache's), the JSON, and bad
options refused by name."""

import json

import pytest

from jaxkv.bench.latent import CASES, main
from jaxkv.cli.bench import BENCHMARKS

TINY = ["--contexts", "8", "24", "--index-topk", "8", "--iters", "1", "--heads", "2", "--rank", "8"]
TINY += ["--rope-dim", "4", "--nope-dim", "4", "--index-dim", "4", "--index-heads", "2"]


def test_smoke(tmp_path, capsys):
    assert main([*TINY, "--out", str(tmp_path / "latent")]) == 0
    assert "| 24 | dsa-attention |" in capsys.readouterr().out
    summary = json.loads((tmp_path / "latent.json").read_text())
    table = {(r["context"], r["case"]): r for r in summary["rows"]}
    assert sorted(table) == sorted((s, case) for s in (8, 24) for case in CASES)
    assert all(r["ms"] > 0 for r in summary["rows"]) and summary["date"]
    mib = 2**20
    # per token: full-head 2 * 2 heads * (4 + 4) = 32 values, latent 8 + 4 = 12, indexer key 4; float32
    assert table[24, "full-head"]["mib_read"] * mib == 24 * 32 * 4
    assert table[24, "latent"]["bytes_vs_full_head"] == 12 / 32
    assert table[8, "dsa-attention"]["mib_read"] == table[24, "dsa-attention"]["mib_read"] == 8 * 12 * 4 / mib
    assert table[24, "dsa"]["mib_read"] * mib == 24 * 4 * 4 + 8 * 12 * 4
    assert BENCHMARKS["latent"] == "jaxkv.bench.latent"


@pytest.mark.parametrize("option", ["--index-topk", "--iters"])
def test_non_positive_options_are_refused(option, capsys):
    with pytest.raises(SystemExit):
        main([option, "0"])
    assert f"{option} must be positive" in capsys.readouterr().err
