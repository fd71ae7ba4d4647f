"""``jaxkv bench serving``: the serving benchmark (docs/benchmarks.md, "Serving"), by what each part does:

* ``workloads``: the seeded requests (random, shared-prefix, multi-turn, copy-heavy, long-generation);
* ``systems``: the systems it runs, their groups and names;
* ``spec``: ``WorkerSpec``, one system on one workload as a worker process receives it;
* ``workers``: the engine, static-batch and transformers workers (vLLM's: ``jaxkv.bench.vllm_worker``);
* ``orchestration``: fresh worker processes, vLLM's venv, repeats and rows;
* ``metrics``: throughput, latencies, medians, greedy agreement, the bandwidth bound;
* ``report``: tables, the chart and the JSON; ``targets``: docs/benchmark-targets.yaml, checked;
* ``cli``: the command line (``main``).

The names below stay importable from the package (``scripts/bench_serving.py``, ``scripts/load_test.py``).
"""

from jaxkv.bench.serving.cli import main, parse_args
from jaxkv.bench.serving.metrics import percentile
from jaxkv.bench.serving.workloads import WorkloadShape, make_workload, token_source, workload_summary
from jaxkv.bench.vllm_worker import Clock, ServingRequest

__all__ = [
    "Clock", "ServingRequest", "WorkloadShape", "main", "make_workload", "parse_args", "percentile", "token_source",
    "workload_summary",
]  # fmt: skip
