"""The serving benchmark (``jaxkv bench serving``, ``scripts/bench_serving.py``) without a model:
the seeded workloads, the metrics, the targets, the table and the parent's loop over workloads
and systems; then smoke runs of every system on a tiny random Llama."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pydantic
import pytest
import yaml
from jaxkv.models.load import Pretrained

from jaxkv.bench import vllm_worker
from jaxkv.bench.serving import cli, metrics, orchestration, report, systems, workers, workloads
from jaxkv.bench.serving.spec import worker_spec
from jaxkv.bench.serving.targets import check_targets, load_targets
from jaxkv.bench.vllm_worker import Record, ServingRequest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def shape(**changes):
    fields = dict(num_requests=64, rate=4.0, min_prompt=16, max_prompt=512, min_output=16, max_output=256,
                  system_prompts=8, system_prompt_tokens=400)  # fmt: skip
    return workloads.WorkloadShape(**(fields | changes))


SOURCE = np.arange(3, 5003)  # increasing ids: a slice's first id gives its offset, a jump where a slice ends


def test_log_uniform_stays_in_range_and_favours_short():
    values = workloads.log_uniform(np.random.default_rng(0), 16, 512, 20_000)
    assert values.min() == 16 and values.max() == 512
    # log-uniform: as many values in [16, 90] as in [91, 512] (each a factor of ~5.7)
    assert abs(np.mean(values <= 90) - 0.5) < 0.02


def test_poisson_arrivals_have_the_rate():
    arrivals = workloads.poisson_arrivals(np.random.default_rng(0), 4.0, 20_000)
    assert np.all(np.diff(arrivals) >= 0)
    assert arrivals[-1] / len(arrivals) == pytest.approx(1 / 4.0, rel=0.03)
    assert not workloads.poisson_arrivals(np.random.default_rng(0), math.inf, 5).any()  # inf: all at the start


def test_random_workload_is_seeded_and_within_bounds():
    requests = workloads.make_workload("random", SOURCE, shape(), seed=0)
    again = workloads.make_workload("random", SOURCE, shape(), seed=0)
    other = workloads.make_workload("random", SOURCE, shape(), seed=1)
    assert requests == again and requests != other
    assert len(requests) == 64
    assert all(16 <= len(r.prompt) <= 512 and 16 <= r.max_tokens <= 256 for r in requests)
    assert [r.arrival for r in requests] == sorted(r.arrival for r in requests)
    assert all(r.prompt == list(range(r.prompt[0], r.prompt[0] + len(r.prompt))) for r in requests)  # one slice


def test_shared_prefix_workload_shares_system_prompts():
    requests = workloads.make_workload("shared-prefix", SOURCE, shape(), seed=0)
    system_lengths = [1 + int(np.flatnonzero(np.diff(r.prompt) != 1)[0]) for r in requests]  # two slices each
    systems = {tuple(r.prompt[:n]) for r, n in zip(requests, system_lengths)}
    assert 4 <= len(systems) <= 8  # 64 requests draw most of the 8
    assert all(380 <= len(system) <= 420 for system in systems)  # 400 +- 5%
    assert all(len(r.prompt) - n >= 16 and len(r.prompt) <= 512 for r, n in zip(requests, system_lengths))


def test_multi_turn_workload_returns_in_rounds_on_its_own_history():
    """Conversations x turns requests; every conversation's turn t arrives before any turn t + 1;
    a turn's prompt is the previous turn's prompt, a corpus reply of the previous turn's output
    length and a user part of --min-prompt..--turn-tokens tokens; seeded."""
    multi = shape(num_requests=6, turns=3, turn_tokens=40, max_output=30, rate=math.inf)
    requests = workloads.make_workload("multi-turn", SOURCE, multi, seed=0)
    assert requests == workloads.make_workload("multi-turn", SOURCE, multi, seed=0)
    assert [r.turn for r in requests] == [t for t in range(3) for _ in range(6)]
    for turn in (1, 2):
        earlier = [r for r in requests if r.turn == turn - 1]
        for r in (r for r in requests if r.turn == turn):
            previous = next(p for p in earlier if r.prompt[: len(p.prompt)] == p.prompt)  # its own history
            added = r.prompt[len(previous.prompt) :]
            reply, user = added[: previous.max_tokens], added[previous.max_tokens :]
            assert reply == list(range(reply[0], reply[0] + len(reply)))  # one corpus slice
            assert 16 <= len(user) <= 40
    first = [len(r.prompt) for r in requests if r.turn == 0]
    assert all(380 + 16 <= n <= 420 + 40 for n in first)  # a system prompt and a user part
    summary = workloads.workload_summary(requests)
    assert summary["distinct_prefix_tokens"] < summary["prompt_tokens"]  # the histories are shared


def test_distinct_prefix_tokens_count_the_prompts_trie():
    assert workloads.distinct_prefix_tokens([[1, 2, 3], [1, 2, 4], [2, 2], [1, 2]]) == 6


def test_turn_latencies_split_first_and_returning_turns():
    records = [Record(0.0, 4.0, 5.0, 2), Record(0.0, 2.0, 5.0, 2), Record(1.0, 1.5, 3.0, 2)]
    latencies = metrics.turn_latencies(records, [0, 0, 1])
    assert latencies["first_ttft_p50_s"] == pytest.approx(3.0) and latencies["first_ttft_p99_s"] > 3.9
    assert latencies["returning_ttft_p50_s"] == latencies["returning_ttft_p99_s"] == pytest.approx(0.5)
    assert metrics.turn_latencies(records, [0, 0, 0]) == {}


def test_tier_systems_options_targets_and_restart(monkeypatch):
    """The memory-tier systems: named only, their engine options, the disk tier's two workers on
    one directory (the second timed), and the multi-turn targets."""
    assert not set(systems.TIER_SYSTEMS) & set(cli.parse_args([]).systems)
    args = cli.parse_args(["--systems", "engine", "engine-host-tier", "engine-disk-tier", "--host-kv-memory",
                           "64MiB", "--workload", "multi-turn"])  # fmt: skip
    specs = {s: worker_spec(args, s, "multi-turn", [], None) for s in args.systems}
    assert specs["engine"].engine.host_kv_memory == 0
    engine = specs["engine-host-tier"].engine
    assert engine.host_kv_memory == "64MiB" and engine.prefix_caching and engine.kv_cache_dir is None
    default = cli.parse_args(["--systems", "engine-host-tier"])
    assert worker_spec(default, "engine-host-tier", "multi-turn", [], None).engine.host_kv_memory == "4GiB"
    calls = []

    def run_worker(spec, vllm, *, timeout, verbose):
        calls.append((spec.label, spec.engine.kv_cache_dir, Path(spec.engine.kv_cache_dir).is_dir()))
        return {"records": []}

    monkeypatch.setattr(orchestration, "run_worker", run_worker)
    restarted = orchestration.run_after_restart(specs["engine-disk-tier"], None, timeout=None, verbose=False)
    assert restarted == {"records": []}
    (fill, fill_dir, fill_exists), (timed, timed_dir, timed_exists) = calls
    assert "filling the disk tier" in fill and timed == "multi-turn / engine-disk-tier"
    assert fill_dir == timed_dir and fill_exists and timed_exists and not Path(timed_dir).exists()
    with pytest.raises(SystemExit):
        cli.parse_args(["--workload", "multi-turn", "--turn-tokens", "8", "--min-prompt", "16"])
    assert cli.parse_args(["--workload", "random", "--turn-tokens", "8", "--min-prompt", "16"]).turn_tokens == 8

    def row(system, tok_s, returning):
        return dict(workload="multi-turn", system=system, output_tok_s=tok_s, returning_ttft_p50_s=returning,
                    stats={})  # fmt: skip

    rows = [row("engine", 50.0, 3.0), row("engine-host-tier", 52.0, 0.5), row("engine-disk-tier", 51.0, 0.9)]
    targets = check_targets(rows)[-3:]
    assert [t["passed"] for t in targets] == [True, True, False]  # 6x lower, 1.04x, 0.9 s > 1.5 x 0.5 s
    assert targets[0]["value"] == pytest.approx(6.0)


def test_copy_heavy_workload_asks_for_a_passage_as_long_as_its_output():
    """Each prompt repeats a corpus passage (``repeated``: twice) whose length is the request's
    output, drawn in --min-output..--max-output; seeded."""
    copy = shape(num_requests=16, min_output=8, max_output=64)
    requests = workloads.make_workload("copy-heavy", SOURCE, copy, seed=0)
    assert requests == workloads.make_workload("copy-heavy", SOURCE, copy, seed=0)
    assert requests != workloads.make_workload("copy-heavy", SOURCE, copy, seed=1)
    for r in requests:
        passage = r.prompt[: r.max_tokens]
        assert 8 <= r.max_tokens <= 64 and r.prompt == passage + passage
        assert passage == list(range(passage[0], passage[0] + r.max_tokens))  # one corpus slice
    asked = workloads.make_workload("copy-heavy", SOURCE, copy, seed=0, copy_prompt=lambda p: [1, *p])
    assert [r.prompt for r in asked] == [[1, *r.prompt[: r.max_tokens]] for r in requests]


def test_the_copy_prompt_asks_twice_in_the_chat_template():
    """SmolLM2's copy prompt: the user asks for the passage, the assistant answers it, the user
    asks again, and the assistant's turn opens."""
    tokenizer = Pretrained("smollm2").tokenizer(required=True)
    passage = tokenizer.encode(" The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    text = tokenizer.decode(workloads.chat_copy_prompt(tokenizer)(passage), skip_special_tokens=False)
    assert text.count(workloads.COPY_INSTRUCTION + "The quick brown fox") == 2 and text.count("lazy dog.") == 3
    opening = tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).split("x")[-1]
    assert text.endswith(opening) and opening.endswith("assistant\n")


class FakeEngine:
    """A driven engine whose requests each finish after their ``max_tokens`` steps, one token a step."""

    def __init__(self):
        self.left: dict[int, int] = {}
        self.most_in_flight = 0

    def submit(self, index, request):
        self.left[index] = request.max_tokens
        self.most_in_flight = max(self.most_in_flight, len(self.left))

    def step(self):
        outputs = [(i, [7], n == 1) for i, n in self.left.items()]
        self.left = {i: n - 1 for i, n in self.left.items() if n > 1}
        return outputs

    def busy(self):
        return bool(self.left)


@pytest.mark.parametrize("limit", [1, 3])
def test_capped_driving_holds_the_concurrency(limit):
    """``--max-concurrency``: never more requests in flight than the cap, each admitted as one
    finishes, every request run to its length; its TTFT counts the wait."""
    requests = [ServingRequest(0.0, [1], n) for n in (3, 1, 2, 4, 2)]
    engine = FakeEngine()
    run = vllm_worker.drive(workers.Capped(engine, limit), requests)
    assert engine.most_in_flight == limit and not engine.left
    assert [r.output_tokens for r in run.records] == [3, 1, 2, 4, 2]
    if limit == 1:  # one at a time, in arrival order: each first token after the previous finish
        assert all(a.finish <= b.first_token for a, b in zip(run.records, run.records[1:]))


def test_speculation_targets_read_concurrency_1_and_the_options_are_checked(capsys):
    """The speculating systems against ``engine`` at concurrency 1: copy-heavy >= 1.8x, random
    >= 0.95x; other caps do not count. The options are refused by name where they cannot apply."""

    def row(kind, system, tok_s, concurrency):
        return dict(workload=kind, system=system, output_tok_s=tok_s, max_concurrency=concurrency, stats={})

    rows = [
        row("copy-heavy", "engine", 100.0, 1), row("copy-heavy", "engine-ngram", 250.0, 1),
        row("random", "engine", 100.0, 1), row("random", "engine-ngram", 90.0, 1),
        row("copy-heavy", "engine", 100.0, 4), row("copy-heavy", "engine-draft", 500.0, 4),
    ]  # fmt: skip
    targets = [t for t in check_targets(rows) if "concurrency 1" in t["target"]]
    assert [(t["target"].split(":")[0], t["target"].split()[3], t["passed"]) for t in targets] == [
        ("copy-heavy, concurrency 1", "engine-ngram", True), ("random, concurrency 1", "engine-ngram", False),
        ("copy-heavy, concurrency 1", "engine-draft", None), ("random, concurrency 1", "engine-draft", None),
    ]  # fmt: skip
    assert targets[0]["value"] == pytest.approx(2.5)
    assert not set(systems.SPECULATIVE_SYSTEMS) & set(cli.parse_args([]).systems)  # named only
    for argv, named in [
        (["--systems", "engine", "static", "--max-concurrency", "1"], "--max-concurrency"),
        (["--systems", "engine", "--max-concurrency", "0"], "--max-concurrency"),
        (["--systems", "engine-ngram", "--speculative-num-tokens", "16"], "--speculative-num-tokens"),
    ]:
        with pytest.raises(SystemExit):
            cli.parse_args(argv)
        assert named in capsys.readouterr().err
    args = cli.parse_args(["--systems", "engine-draft", "--max-concurrency", "1", "4", "--speculative-draft-model",
                           "gemma3"])  # fmt: skip
    spec = worker_spec(args, "engine-draft", "copy-heavy", [], None, 4)
    speculative = spec.engine.speculative
    assert spec.max_concurrency == 4 and speculative.draft_model == "gemma3" and speculative.num_tokens == 4
    assert spec.label == "copy-heavy / engine-draft / concurrency 4"
    own = worker_spec(cli.parse_args(["--systems", "engine-draft"]), "engine-draft", "random", [], None)
    assert own.engine.speculative.draft_model == "smollm2"
    assert worker_spec(cli.parse_args([]), "engine", "random", [], None).engine.speculative is None


def test_token_slices_refuse_a_short_source():
    with pytest.raises(ValueError, match="fewer than a 600-token prompt"):
        workloads.token_slices(np.random.default_rng(0), SOURCE[:500], [600])


def test_summarize_computes_rates_and_latencies():
    records = [Record(0.0, 1.0, 3.0, 5), Record(1.0, 1.5, 4.0, 6), Record(2.0, 4.0, 4.0, 1)]
    summary = metrics.summarize(records)
    assert summary["makespan_s"] == 4.0 and summary["output_tokens"] == 12
    assert summary["output_tok_s"] == 3.0 and summary["requests_s"] == 0.75
    assert summary["ttft_p50_s"] == 1.0  # TTFTs 1.0, 0.5, 2.0
    assert summary["ttft_p99_s"] == pytest.approx(1.0 + 0.98 * (2.0 - 1.0))  # linear interpolation
    # TPOT of the requests with more than one token: (3 - 1) / 4 = 0.5 s and (4 - 1.5) / 5 = 0.5 s
    assert summary["tpot_p50_ms"] == pytest.approx(500.0) and summary["tpot_p99_ms"] == pytest.approx(500.0)
    assert metrics.percentile([], 50) is None


def test_check_lengths_names_the_wrong_requests():
    requests = [ServingRequest(0.0, [1, 2], 3), ServingRequest(0.0, [1], 2)]
    records = [Record(0.0, 1.0, 2.0, 3), Record(0.0, 1.0, 2.0, 1)]
    with pytest.raises(RuntimeError, match=r"\(1, 1, 2\)"):
        vllm_worker.check_lengths(records, requests, "hf")


def test_static_batches_compile_once_per_shape():
    Request = ServingRequest
    a = [Request(0.0, [1] * 20, 16), Request(0.0, [1] * 30, 8)]  # rows 2, width 32, 16 new tokens
    b = [Request(0.0, [1] * 17, 16), Request(0.0, [1] * 32, 4)]  # the same shape
    c = [Request(0.0, [1] * 33, 16)]
    assert workers.batch_shape(a) == workers.batch_shape(b) == (2, 32, 16)
    assert workers.distinct_shapes([a, b, c]) == [a, c]


def test_targets_and_table():
    def row(kind, system, tok_s, ttft, **stats):
        return dict(workload=kind, system=system, output_tok_s=tok_s, requests_s=1.0, ttft_p50_s=ttft,
                    ttft_p99_s=ttft, tpot_p50_ms=10.0, tpot_p99_ms=20.0, cpu_ms_per_token=12.5, repeats=1,
                    stats=dict.fromkeys(metrics.STAT_KEYS) | stats)  # fmt: skip

    rows = [
        row("random", "engine", 300.0, 0.1, wasted_slot_fraction=0.03, prefix_hit_rate=0.0, num_compiled=6),
        row("random", "engine-no-prefix", 303.0, 0.1),
        row("random", "static", 150.0, 1.0),
        row("random", "hf", 100.0, 0.5),
        row("shared-prefix", "engine", 400.0, 0.2),
        row("shared-prefix", "engine-no-prefix", 300.0, 0.5),
        dict(workload="shared-prefix", system="hf", error="exit 1: boom"),
        row("shared-prefix", "vllm", 350.0, 0.3) | dict(repeats=3, output_tok_s_min_max=[340.0, 360.0],
                                                        agreement=dict(equal=63, total=64, reference="engine")),
    ]  # fmt: skip
    targets = check_targets(rows)
    # 3x HF, 2x static, 3% wasted, TTFT only 2.5x lower with prefix caching, 1% slower at 0% hits; no vLLM on
    # random, and 400 / 350 = 1.14x vLLM on shared-prefix; no multi-turn rows: its three tier targets not measured
    # no concurrency-1 rows: the four speculation targets not measured
    assert [t["passed"] for t in targets] == [True, True, True, False, True, None, False, *[None] * 4, None, None,
                                              None], targets  # fmt: skip
    assert targets[6]["value"] == pytest.approx(400 / 350)
    cost = targets[4]
    assert cost["value"] == pytest.approx(300 / 303) and cost["display"] == "0.99x"
    assert cost["target"] == "random: prefix caching keeps >= 98% of the output tok/s (engine / no-prefix)"
    assert check_targets(rows[2:4])[0]["passed"] is None  # no engine row: not measured
    table = report.markdown_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[2].startswith("| random | jaxkv engine | 300.0 | 1.00 | 0.10 |")
    assert table[2].endswith("| 12.5 | - | - | 3.0 | 0.0 | 6 |")  # CPU ms/token, agreement, K/V, wasted %, hits %
    assert "failed: exit 1: boom" in table[-2]
    # vLLM over 3 runs: median (min-max) output tok/s, 63 of 64 requests with the engine's greedy tokens
    assert table[-1].startswith("| shared-prefix | vLLM (its defaults) | 350.0 (340.0-360.0) | 1.00 |")
    assert "| 12.5 | 63/64 |" in table[-1]


def test_the_targets_file_parses_and_names_metrics_of_the_report(tmp_path):
    """docs/benchmark-targets.yaml: every target reads a metric a row of the report carries (one of
    its medians, or one of its statistics), names what it measures rather than an issue, and says
    where it came from; a target naming a metric the report lacks is refused by name."""
    loaded = load_targets()
    assert len(loaded) == 16
    row_metrics = set(metrics.REPEATED_METRICS) | {f"stats.{key}" for key in metrics.STAT_KEYS}
    for target in loaded:
        assert target.metric in row_metrics, target
        assert "issue" not in target.name and target.note.startswith("issue "), target
        assert target.workload in workloads.WORKLOADS
    row = metrics.make_row("random", "engine", [dict.fromkeys(metrics.REPEATED_METRICS, 1.0)])
    assert set(metrics.REPEATED_METRICS) <= set(row)
    wrong = tmp_path / "targets.yaml"
    entry = loaded[0].model_dump() | {"metric": "tokens_per_second"}
    wrong.write_text(yaml.safe_dump({"serving": [entry]}))
    with pytest.raises(pydantic.ValidationError, match="unknown metric 'tokens_per_second'"):
        load_targets(wrong)


def test_quick_sets_defaults_that_flags_override():
    args = cli.parse_args(["--quick", "--requests", "5", "--systems", "static", "hf"])
    assert args.requests == 5 and args.max_prompt == cli.QUICK["max_prompt"]
    assert cli.parse_args([]).requests == 64
    with pytest.raises(SystemExit):
        cli.parse_args(["--systems", "static", "--min-prompt", "600"])


def test_competing_process_is_pinned_and_stopped():
    """``--competing-cpu``: a busy loop on the named CPU while the block runs, gone after it;
    a CPU the machine lacks is refused by name."""
    with orchestration.competing_process(0) as busy:
        assert busy.args == [sys.executable, "-c", orchestration.BUSY_LOOP]
        assert busy.poll() is None and os.sched_getaffinity(busy.pid) == {0}
    assert busy.poll() is not None  # killed and reaped
    with orchestration.competing_process(None) as nothing:
        assert nothing is None
    with pytest.raises(SystemExit):
        cli.parse_args(["--competing-cpu", "4096"])


def test_both_workloads_run_every_system_in_a_fresh_worker_each(monkeypatch):
    """The parent's loop over ``--workload both`` (the default; each smoke run below names one
    workload, and a worker runs the same code on either): per workload, every system once per
    ``--repeat`` round, then the rows workload by workload in ``--systems`` order."""
    runs = []

    def run_once(args, spec, vllm):  # a worker's result, without the worker
        runs.append((spec.workload, spec.system, len(spec.requests)))
        return dict.fromkeys(metrics.REPEATED_METRICS, 1.0)

    monkeypatch.setattr(orchestration, "run_once", run_once)
    args = cli.parse_args(["--model", "tiny-random", "--quick", "--requests", "3", "--repeat", "2", "--systems",
                           "static", "hf"])  # fmt: skip
    rows = orchestration.run_all(args, workloads.build_workloads(args), None)
    assert runs == [(kind, system, 3) for kind in workloads.BOTH for _ in range(2) for system in ("static", "hf")]
    assert [(r["workload"], r["system"], r["repeats"]) for r in rows] == [
        (kind, system, 2) for kind in workloads.BOTH for system in ("static", "hf")
    ]


def test_static_and_transformers_on_a_tiny_llama(tmp_path):
    """The parent and two workers (jaxkv static, transformers CB) end to end on the random
    workload (the loop over both workloads: the test above)."""
    out = tmp_path / "serving.json"
    args = ["--model", "tiny-random", "--quick", "--requests", "4", "--workload", "random", "--systems", "static",
            "hf", "--out", str(out)]  # fmt: skip
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_serving.py"), *args], check=False,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["workload"], r["system"]) for r in report["rows"]] == [("random", "static"), ("random", "hf")]
    for row in report["rows"]:
        assert "error" not in row, row
        assert len(row["records"]) == 4 and row["output_tok_s"] > 0
        assert all(r["arrival"] <= r["first_token"] <= r["finish"] for r in row["records"])
        assert row["stats"]["peak_kv_bytes"] > 0
        # the worker's start-up (process start to first request) is out of the clock, and in the end-to-end rate
        assert row["startup_s"] > 0 and row["end_to_end_tok_s"] < row["output_tok_s"]
        assert row["cpu_ms_per_token_with_startup"] > row["cpu_ms_per_token"]
    static = report["rows"][0]["stats"]
    assert static["xla_compiles_run"] == 0 and 0 < static["wasted_slot_fraction"] < 1  # warm-up compiled it all
    assert "| random | transformers CB (CPU) |" in proc.stdout and "### Targets" in proc.stdout
    assert "start-up (outside the clock above) and end to end" in proc.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 0


def test_engine_systems_on_a_tiny_llama(tmp_path):
    """Both engine workers on the shared-prefix workload, through ``jaxkv bench serving``: warmed
    up, no compile while serving, and only the engine with prefix caching reuses the system
    prompts' pages. 8 rows, 64 tokens a step and 16 MiB of pages hold the 6 requests: 4 step
    shapes to compile instead of the defaults' 8, and a smaller pool to allocate."""
    out = tmp_path / "serving.json"
    args = ["--model", "tiny-random", "--quick", "--requests", "6", "--workload", "shared-prefix", "--rate", "inf",
            "--systems", "engine", "engine-no-prefix", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--kv-memory", "16MiB", "--out", str(out)]  # fmt: skip
    cli = Path(sys.executable).with_name("jaxkv")  # `jaxkv bench serving`, the console script
    proc = subprocess.run([str(cli), "bench", "serving", *args], check=False, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine, no_prefix = json.loads(out.read_text())["rows"]
    for row in (engine, no_prefix):
        assert "error" not in row, row
        assert [r["output_tokens"] for r in row["records"]] == [r["output_tokens"] for r in engine["records"]]
        assert row["stats"]["xla_compiles_run"] == 0 and row["stats"]["num_compiled"] > 0
    assert engine["stats"]["prefix_hit_rate"] > 0 and no_prefix["stats"]["prefix_hit_rate"] == 0


def test_speculating_engines_on_a_tiny_llama(tmp_path):
    """engine, engine-ngram and engine-draft (the model drafting for itself) on the copy-heavy
    workload at concurrency 2, every draft verified (``--speculative-always-verify``: whether the measured rule
    verifies depends on timing): the same greedy tokens as the engine, drafts proposed and accepted
    (the draft model's all but never rejected), the speculation table printed."""
    out = tmp_path / "serving.json"
    args = ["--model", "tiny-random", "--quick", "--requests", "4", "--workload", "copy-heavy", "--rate", "inf",
            "--systems", "engine", "engine-ngram", "engine-draft", "--max-concurrency", "2", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "64", "--kv-memory", "16MiB", "--speculative-always-verify",
            "--out", str(out)]  # fmt: skip
    cli = Path(sys.executable).with_name("jaxkv")
    proc = subprocess.run([str(cli), "bench", "serving", *args], check=False, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine, ngram, draft = json.loads(out.read_text())["rows"]
    assert all(row["max_concurrency"] == 2 and "error" not in row for row in (engine, ngram, draft))
    for row in (ngram, draft):
        assert row["agreement"]["equal"] == row["agreement"]["total"] == 4
        assert row["stats"]["xla_compiles_run"] == 0
    assert engine["stats"]["speculation"]["proposed"] == 0 and ngram["stats"]["speculation"]["proposed"] > 0
    spec = draft["stats"]["speculation"]
    assert spec["accepted"] >= 0.9 * spec["proposed"] > 0 and spec["mean_accepted_length"] > 2
    assert "| copy-heavy, concurrency 2 | jaxkv engine + draft-model speculation |" in proc.stdout
    assert "speculative decoding in the engine" in proc.stdout


def test_multi_turn_with_the_host_tier_on_a_tiny_llama(tmp_path):
    """The multi-turn workload through the engine with and without the host page tier: a 1 MiB
    device pool (512 tokens of the tiny model) below the conversations' working set, so returning
    turns find their history on the host tier; both generate the same tokens, and the rows carry
    first- and returning-turn TTFT."""
    out = tmp_path / "serving.json"
    # --kv-memory-mib and --host-kv-memory-mib: the deprecated spellings, still read
    args = ["--model", "tiny-random", "--quick", "--requests", "16", "--turns", "2", "--turn-tokens", "16",
            "--workload", "multi-turn", "--rate", "inf", "--systems", "engine", "engine-host-tier",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--kv-memory-mib", "1",
            "--host-kv-memory-mib", "16", "--out", str(out)]  # fmt: skip
    cli = Path(sys.executable).with_name("jaxkv")
    proc = subprocess.run([str(cli), "bench", "serving", *args], check=False, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["workloads"]["multi-turn"]["distinct_prefix_tokens"] > 512  # more than the device pool holds
    engine, host = report["rows"]
    assert host["agreement"]["equal"] == host["agreement"]["total"] == 32
    assert host["stats"]["tiers"]["host"]["hit_pages"] > 0 and engine["stats"]["tiers"]["host"]["hit_pages"] == 0
    assert all(row["returning_ttft_p50_s"] is not None and row["first_ttft_p50_s"] is not None
               for row in (engine, host))  # fmt: skip
    assert "returning turns" in proc.stdout


def test_compressed_engine_systems_are_named_by_their_budget():
    """``engine-compact-<pages>`` runs as the engine with that page budget; other names are refused."""
    args = cli.parse_args(["--systems", "engine", "engine-compact-16", "--compaction-policy", "h2o",
                           "--workload", "long-generation"])  # fmt: skip
    engine = worker_spec(args, "engine-compact-16", "long-generation", [], None).engine
    assert engine.max_pages_per_request == 16 and engine.compaction_policy == "h2o" and engine.prefix_caching
    assert worker_spec(args, "engine", "random", [], None).engine.max_pages_per_request is None
    assert systems.system_title("engine-compact-16") == "jaxkv engine, <= 16 pages / request"
    for wrong in ("engine-compact-1", "engine-compact-x", "engine-compact-"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--systems", wrong])


def test_kv_bytes_per_request_counts_whole_pages_up_to_the_budget():
    requests = [ServingRequest(0.0, [1] * 10, 23), ServingRequest(0.0, [1] * 3, 2)]  # 32 and 4 tokens
    stats = dict(page_size=8, page_bytes=100)
    assert metrics.kv_bytes_per_request(requests, stats, None) == (4 + 1) / 2 * 100
    assert metrics.kv_bytes_per_request(requests, stats, 3) == (3 + 1) / 2 * 100


def test_compaction_targets_and_table():
    def row(system, tok_s, mean_running):
        stats = dict(peak_running=8, mean_running=mean_running, kv_bytes_per_request=2**20, compactions=3,
                     preemptions=0)  # fmt: skip
        return dict(workload="long-generation", system=system, max_concurrency=None, output_tok_s=tok_s,
                    ttft_p50_s=0.5, tpot_p50_ms=20.0, stats=stats)  # fmt: skip

    rows = [row("engine", 100.0, 4.0), row("engine-compact-8", 190.0, 8.0), row("engine-compact-4", 150.0, 8.0)]
    targets = [t for t in check_targets(rows) if t["target"].startswith("long-generation")]
    # each engine-compact-<pages> row: rows a step (8 / 4 twice), then output tok/s (1.9x and 1.5x)
    assert [(t["value"], t["passed"]) for t in targets] == [(2.0, True), (2.0, True), (1.9, True), (1.5, False)]
    assert targets[0]["target"] == "long-generation: engine-compact-8 >= 2x engine's rows a step"
    table = report.compaction_table(rows)
    assert "| long-generation | jaxkv engine, <= 8 pages / request | 190.0 | 1.90 | 8.0 / 8 |" in table
    assert report.compaction_table(rows[:1]) == ""  # no compressed engine, no table


def test_compressed_pages_on_a_tiny_llama(tmp_path):
    """engine and engine-compact-4 on the long-generation workload: 2 MiB of pages (64 pages of
    16 tokens of the tiny model) hold about 5 of the 8 requests of 200 tokens uncompressed (13
    pages each), all 8 at 4 pages each; the compressed engine compacts, holds 4 pages per request
    and runs more rows a step."""
    out = tmp_path / "serving.json"
    args = ["--model", "tiny-random", "--quick", "--requests", "8", "--workload", "long-generation", "--rate", "inf",
            "--systems", "engine", "engine-compact-4", "--min-prompt", "8", "--max-prompt", "16", "--min-output",
            "192", "--max-output", "192", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--kv-memory",
            "2MiB", "--out", str(out)]  # fmt: skip
    cli = Path(sys.executable).with_name("jaxkv")
    proc = subprocess.run([str(cli), "bench", "serving", *args], check=False, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine, compact = (row["stats"] for row in json.loads(out.read_text())["rows"])
    assert engine["compactions"] == 0 and compact["compactions"] > 0 and compact["xla_compiles_run"] == 0
    assert compact["kv_bytes_per_request"] == 4 * compact["page_bytes"] < engine["kv_bytes_per_request"]
    assert compact["mean_running"] > engine["mean_running"] and compact["preemptions"] == 0 < engine["preemptions"]
    assert "compressed pages in the engine" in proc.stdout and "engine-compact-4 >= 2x engine's rows" in proc.stdout
