"""``jaxkv bench attention`` (jaxkv.bench.attention) at tiny sizes on CPU, its kernels interpreted:
the table and the JSON hold a row per path, batch and context, the kernels' outputs agree with
XLA's, and a device JAX does not run on is refused."""

import json

from jaxkv.bench.attention import PATHS, main
from jaxkv.bench.serving.cli import parse_args
from jaxkv.bench.serving.spec import worker_spec
from jaxkv.cli.bench import BENCHMARKS

TINY = ["--batch", "1", "2", "--context", "40", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
TINY += ["--page-size", "4", "--iters", "1", "--bandwidth-mib", "8"]


def test_smoke_on_cpu(tmp_path, capsys):
    assert main(["--device", "cpu", *TINY, "--out", str(tmp_path / "attention")]) == 0
    assert "| 2 | 40 | kernel-heads | pallas_gpu |" in capsys.readouterr().out
    summary = json.loads((tmp_path / "attention.json").read_text())
    assert [(r["batch"], r["path"]) for r in summary["rows"]] == [(b, p) for b in (1, 2) for p in PATHS]
    for row in summary["rows"]:
        assert row["max_diff"] < 2e-2 and row["tok_s"] > 0 and row["hbm_pct"] > 0  # bfloat16 K/V
    assert summary["bandwidth_gb_s"] > 0 and summary["date"]
    assert BENCHMARKS["attention"] == "jaxkv.bench.attention"


def test_a_device_jax_does_not_run_on_is_refused(capsys):
    assert main(["--device", "gpu", *TINY]) == 2
    assert "--device gpu, but JAX runs on cpu" in capsys.readouterr().err


def test_bench_serving_passes_the_backend_to_the_engine():
    """``jaxkv bench serving --attention-backend pallas_gpu``: the engine systems' engines carry it."""

    def backend(argv):
        return worker_spec(parse_args(argv), "engine", "random", [], None).engine.attention_backend

    assert backend(["--attention-backend", "pallas_gpu"]) == "pallas_gpu" and backend([]) == "xla"
