"""`jaxkv bench serving --device gpu` (issue 38): which systems run there, the memory-bandwidth
bound of a workload's decode, and the refusal on a machine without a GPU (this one)."""

import math

import pytest

from jaxkv.bench.serving import cli, metrics, systems
from jaxkv.bench.serving.spec import worker_spec
from jaxkv.bench.vllm_worker import ServingRequest


def test_the_gpu_runs_jaxkvs_systems_by_default():
    assert cli.parse_args(["--device", "gpu"]).systems == list(systems.GPU_SYSTEMS)
    assert "hf" in cli.parse_args([]).systems  # the CPU default is unchanged


@pytest.mark.parametrize("others", [["hf"], ["engine", "vllm"], ["vllm-matched"]])
def test_the_gpu_refuses_systems_that_run_on_the_cpu(others, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "gpu", "--systems", *others])
    message = capsys.readouterr().err
    assert "--device gpu" in message
    assert all(name in message for name in others if name not in systems.GPU_SYSTEMS)


def test_workers_run_where_their_system_runs():
    args = cli.parse_args(["--device", "gpu", "--quick", "--model", "tiny-random"])
    requests = [ServingRequest(arrival=0.0, prompt=[1, 2, 3], max_tokens=2)]
    assert worker_spec(args, "engine", "random", requests, None).device == "gpu"
    cpu_args = cli.parse_args(["--quick", "--model", "tiny-random"])
    assert worker_spec(cpu_args, "hf", "random", requests, None).device == "cpu"


def test_the_bound_reads_the_weights_once_per_step_and_each_tokens_context_once():
    requests = [
        ServingRequest(arrival=0.0, prompt=[7] * 4, max_tokens=3),  # decodes 2 tokens over 5 and 6 cached
        ServingRequest(arrival=0.0, prompt=[7] * 2, max_tokens=2),  # decodes 1 token over 3 cached
    ]
    sizes = dict(param_bytes=100, kv_bytes_per_token=10)
    bound = metrics.decode_bandwidth_bound(requests, max_num_seqs=2, sizes=sizes, gbps=1.0)
    assert bound["decode_steps"] == 2  # 3 decoded tokens, 2 rows a step
    assert bound["weight_bytes"] == 200
    assert bound["kv_bytes"] == (5 + 6 + 3) * 10
    assert math.isclose(bound["output_tok_s"], 5 * 1e9 / 340)
    one_row = metrics.decode_bandwidth_bound(requests, max_num_seqs=1, sizes=sizes, gbps=1.0)
    assert one_row["decode_steps"] == 3 and one_row["output_tok_s"] < bound["output_tok_s"]


def test_each_jaxkv_row_is_a_fraction_of_its_workloads_bound():
    requests = [ServingRequest(arrival=0.0, prompt=[7] * 4, max_tokens=3)]
    sizes = dict(param_bytes=100, kv_bytes_per_token=10)
    rows = [
        dict(workload="random", system="engine", output_tok_s=2.0e6, runs=[dict(sizes=sizes)]),
        dict(workload="random", system="static", output_tok_s=1.0e6, runs=[dict(sizes=sizes)]),
        dict(workload="random", system="engine-no-prefix", error="exit 1"),
    ]
    bounds = metrics.bandwidth_bounds(rows, {"random": requests}, dict(gbps=1.0), max_num_seqs=4)
    expected = metrics.decode_bandwidth_bound(requests, 4, sizes, 1.0)["output_tok_s"]
    assert bounds["random"]["fraction"] == {"engine": 2.0e6 / expected, "static": 1.0e6 / expected}


def test_without_a_gpu_the_run_stops_before_any_system_with_the_reason(tmp_path, capsys):
    out = tmp_path / "serving.json"
    assert cli.main(["--device", "gpu", "--quick", "--model", "tiny-random", "--out", str(out)]) == 2
    assert "JAX found no GPU" in capsys.readouterr().err
    assert not out.exists()
