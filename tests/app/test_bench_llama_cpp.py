"""llama.cpp in the decode benchmark: the worker's greedy loop against a fake of llama.cpp's
context, its context sizing and imports, the venv's build steps and flags, the parent's rows (a
fake worker's result through ``run_configurations``, the bytes each row's decode step reads, the
llama.cpp targets, the refusals), and one run of the real llama.cpp on SmolLM2's GGUF file (its
venv made where missing: ``python -m jaxkv.bench.llama_cpp_env``, several minutes)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxkv.bench import decode, llama_cpp_env, llama_cpp_worker

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_decode.py"


class FakeDecoder:
    """``llama_cpp_worker.Decoder`` without llama.cpp: the greedy token of an entry is its token + 1
    + 100 x its sequence; ``greedy`` refuses an entry without logits (llama.cpp would abort)."""

    def __init__(self):
        self.calls: list[list[tuple[int, int, int, bool]]] = []

    def decode(self, tokens):
        self.calls.append(list(tokens))

    def greedy(self, index: int) -> int:
        token, _, sequence, logits = self.calls[-1][index]
        assert logits, f"entry {index} has no logits"
        return token + 1 + 100 * sequence


def test_generate_rows_prefills_every_sequence_then_decodes_one_token_each_a_step():
    decoder = FakeDecoder()
    rows = llama_cpp_worker.generate_rows(decoder, [5, 6, 7], batch=2, new_tokens=3)
    prefill, *steps = decoder.calls
    assert prefill == [(5, 0, 0, False), (6, 1, 0, False), (7, 2, 0, True), (5, 0, 1, False), (6, 1, 1, False),
                       (7, 2, 1, True)]  # fmt: skip
    # row 0 continues 7 -> 8 -> 9 -> 10; row 1 adds 100 a step: 7 -> 108 -> 209 -> 310
    assert steps == [[(8, 3, 0, True), (108, 3, 1, True)], [(9, 4, 0, True), (209, 4, 1, True)]]
    assert rows.tokens == [[8, 9, 10], [108, 209, 310]]
    assert rows.start <= rows.first_token <= rows.end


def test_one_new_token_is_the_prefill_alone():
    decoder = FakeDecoder()
    assert llama_cpp_worker.generate_rows(decoder, [1], batch=1, new_tokens=1).tokens == [[2]]
    assert len(decoder.calls) == 1


def test_the_context_holds_every_sequence_in_whole_rounds():
    assert llama_cpp_worker.context_cells(batch=1, prompt_tokens=32, new_tokens=96) == 256
    assert llama_cpp_worker.context_cells(batch=8, prompt_tokens=32, new_tokens=256) == 8 * 512


def test_the_worker_imports_only_the_standard_library_and_llama_cpp():
    """llama.cpp's venv has no jaxkv: the worker file imports the standard library and ``llama_cpp`` alone."""
    tree = ast.parse(Path(llama_cpp_worker.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}  # fmt: skip
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported - set(sys.stdlib_module_names) == {"llama_cpp"}


def test_the_venv_is_built_from_source_natively_once(tmp_path, monkeypatch):
    commands = []

    def run(command, **kwargs):
        commands.append((command, kwargs.get("env")))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(llama_cpp_env.platform, "machine", lambda: "x86_64")
    python = llama_cpp_env.ensure_venv(tmp_path)
    assert python == tmp_path / "bin" / "python"
    (venv, _), (install, env), (check, _) = commands
    assert venv == [sys.executable, "-m", "venv", str(tmp_path)]
    assert install[:3] == [str(python), "-m", "pip"] and install[-1] == "llama-cpp-python==0.3.36"
    assert "--no-binary" in install and "--no-cache-dir" in install  # compiled here, never a wheel from elsewhere
    assert "-DGGML_NATIVE=ON" in env["CMAKE_ARGS"].split() and "-DGGML_CUDA=OFF" in env["CMAKE_ARGS"].split()
    assert "-mno-amx-int8" in env["CFLAGS"] and "-mno-amx-tile" in env["CXXFLAGS"]
    assert check == [str(python), "-c", "import llama_cpp"]
    assert "CMAKE_ARGS=" in (tmp_path / llama_cpp_env.MARKER).read_text()
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    assert llama_cpp_env.ensure_venv(tmp_path) == python  # the marker: made once


def test_a_failed_build_says_why(tmp_path, monkeypatch):
    def run(command, **kwargs):
        failed = "pip" in command
        return subprocess.CompletedProcess(command, int(failed), "", "error: cmake not found" if failed else "")

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(llama_cpp_env.LlamaCppUnavailable, match=r"(?s)pip install llama-cpp-python==0\.3\.36 .*"
                       "g\\+\\+ and cmake installed.*cmake not found"):  # fmt: skip
        llama_cpp_env.ensure_venv(tmp_path)
    assert not (tmp_path / llama_cpp_env.MARKER).exists()  # the next run tries again


def test_llama_cpp_runs_only_when_named_and_only_on_the_cpu():
    assert not {"llama.cpp", "llama.cpp-1-thread"} & set(decode.parse_args([]).systems)
    args = decode.parse_args(["--systems", "jaxkv-static", "llama.cpp", "--weights", "gguf"])
    assert args.systems == ["jaxkv-static", "llama.cpp"] and args.weights == "gguf"
    with pytest.raises(SystemExit):
        decode.parse_args(["--systems", "llama.cpp", "--device", "gpu"])


def test_a_model_that_is_no_gguf_file_gives_error_rows_without_a_build(tmp_path):
    args = decode.parse_args(["--model", "tiny-random", "--systems", "llama.cpp", "llama.cpp-1-thread", "--batch",
                              "1", "2", "--llama-cpp-venv", str(tmp_path / "none")])  # fmt: skip
    rows = decode.run_configurations(args, [1, 2, 3], dict(model="tiny-random", dtype="float32", threads=2,
                                                           device="cpu"))  # fmt: skip
    assert [(r["name"], r["batch"]) for r in rows] == [("llama.cpp", 1), ("llama.cpp-1-thread", 1), ("llama.cpp", 2),
                                                       ("llama.cpp-1-thread", 2)]  # fmt: skip
    assert all(r["error"] == "llama.cpp runs a GGUF file; --model tiny-random is not one" for r in rows)
    assert not (tmp_path / "none").exists()


FAKE_WORKER = """
import json, sys
spec = json.loads(open(sys.argv[1]).read())
result = dict(prefill_s=0.5, decode_s=(spec["new_tokens"] - 1) / 50.0, compile_s=0.0, ttft_s=0.6, cache_bytes=4096,
              param_bytes=100 * 2**20, kv_bytes_per_token=1000, tokens_head=[1, 2, 3], rows_identical=True,
              threads=spec["threads"], model_path=spec["model_path"], prompt=spec["prompt"], batch=spec["batch"],
              peak_rss_mib=10.0)
open(spec["result_path"], "w").write(json.dumps(result))
"""


def test_a_llama_cpp_row_from_its_worker(tmp_path, monkeypatch):
    """The parent's path for a llama.cpp configuration, with a stand-in worker: the GGUF file, the
    prompt, the batch and the threads (``--threads``; 1 for ``llama.cpp-1-thread``) go to it, its
    result becomes a row with rates and, in ``main``, the bytes its decode step reads."""
    worker = tmp_path / "worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(decode, "llama_cpp_setup", lambda args: ([sys.executable, str(worker)], None))
    monkeypatch.setattr(decode, "gguf_path", lambda model: Path("/models/m.gguf"))
    args = decode.parse_args(["--systems", "llama.cpp", "llama.cpp-1-thread", "--batch", "2", "--new-tokens", "11",
                              "--threads", "3", "--repeat", "2"])  # fmt: skip
    common = dict(model="smollm2", dtype="float32", threads=args.threads, device="cpu")
    rows = decode.run_configurations(args, [7, 8], common)
    for row, threads in zip(rows, (3, 1)):
        assert "error" not in row, row
        assert row["threads"] == threads and row["model_path"] == "/models/m.gguf" and row["prompt"] == [7, 8]
        assert row["batch"] == 2 and row["system"] == "llama.cpp" and row["cache"] == "static f16"
        assert row["decode_tok_s"] == pytest.approx(2 * 50.0) and row["decode_tok_s_runs"] == [row["decode_tok_s"]] * 2
    row = rows[0]
    # 100 MiB of weights + 2 rows x (2 + 11 / 2) tokens x 1000 bytes, 50 steps a second
    measured = decode.decode_bytes(row, gbps=10.0)
    step = 100 * 2**20 + 2 * 7.5 * 1000
    assert measured["bytes_per_step"] == pytest.approx(step) and measured["bytes_per_token"] == pytest.approx(step / 2)
    assert measured["streamed_gbps"] == pytest.approx(step * 50 / 1e9)
    assert measured["fraction_of_bandwidth"] == pytest.approx(step * 50 / 1e9 / 10.0)
    assert measured["tok_s_bound"] == pytest.approx(10e9 / step * 2)
    assert decode.decode_bytes(row, gbps=None)["fraction_of_bandwidth"] is None


def bench_row(name: str, batch: int, tok_s: float, fraction: float | None = None) -> dict:
    system, cache, _ = decode.CONFIGS[name]
    return dict(name=name, system=system, cache=cache, batch=batch, decode_tok_s=tok_s, threads=2,
                bytes=dict(weight_bytes=2**20, kv_bytes=2**19, bytes_per_token=1.5 * 2**20 / batch, streamed_gbps=1.0,
                           fraction_of_bandwidth=fraction, tok_s_bound=None))  # fmt: skip


def test_llama_cpp_targets_and_the_bytes_table():
    rows = [bench_row("jaxkv-static", 1, 60.0, fraction=0.9), bench_row("llama.cpp", 1, 75.0, fraction=0.5),
            bench_row("llama.cpp-1-thread", 1, 45.0), dict(name="llama.cpp", system="llama.cpp", batch=8, error="x")]
    ratio, fraction = decode.llama_cpp_targets([r for r in rows if "error" not in r])
    assert ratio["value"] == pytest.approx(0.8) and ratio["passed"] is False and ratio["display"] == "0.80x"
    assert ratio["target"] == "b1 decode jaxkv-static >= 1x llama.cpp (2 threads), same file"
    assert fraction["value"] == 0.9 and fraction["passed"] is True and fraction["display"] == "90.0%"
    assert decode.llama_cpp_targets(rows[:1]) == []  # no llama.cpp row: nothing to compare with
    missing = decode.llama_cpp_targets(rows[1:3])  # no jaxkv row
    assert [t["passed"] for t in missing] == [None, None]
    table = decode.bytes_table(rows).splitlines()
    assert len(table) == 2 + 3  # the failed row has nothing to show
    assert table[3] == "| llama.cpp | 1 | 1.0 | 0.50 | 1.5 | 75.0 | 1.0 | 50.0% | - |"
    assert table[4].startswith("| llama.cpp, 1 thread | 1 |") and table[4].endswith("| - | - |")


@pytest.fixture(scope="module")
def llama_cpp_python():
    """The python of llama.cpp's venv; made here where the setup has not made it (several minutes)."""
    return llama_cpp_env.ensure_venv()


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the build where the venv is missing: ~17 minutes on 2 busy cores
def test_llama_cpp_decodes_smollm2s_gguf_file(llama_cpp_python, tmp_path):
    """The real llama.cpp on the shipped SmolLM2 Q4_1 file, through ``jaxkv bench decode``: batch 1
    and 2, every row of a batch the same greedy tokens, its weights the file's tensors, its K/V
    f16 (2 x 30 layers x 3 heads x 64 x 2 bytes a token), the bytes it reads against the bandwidth."""
    from jaxkv.models.defaults import resolve_model

    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "smollm2", "--systems", "llama.cpp",
                           "llama.cpp-1-thread", "--batch", "1", "2", "--new-tokens", "8", "--prompt-tokens", "12",
                           "--membw-mib", "64", "--out", str(out)], check=False, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["name"], r["batch"]): r for r in report["rows"]}
    assert set(rows) == {(name, batch) for name in ("llama.cpp", "llama.cpp-1-thread") for batch in (1, 2)}
    file_bytes = resolve_model("smollm2").stat().st_size
    for (name, batch), row in rows.items():
        assert "error" not in row, row
        assert row["threads"] == (1 if name == "llama.cpp-1-thread" else report["settings"]["threads"])
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and len(row["tokens_head"]) == 8
        assert row["rows_identical"] and row["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
        assert 0.9 * file_bytes < row["param_bytes"] < file_bytes  # the tensors, without the file's metadata
        assert row["bytes"]["fraction_of_bandwidth"] > 0
    # greedy on the same file and prompt: the same tokens on 1 or 2 threads, at batch 1 or 2
    assert len({tuple(row["tokens_head"]) for row in rows.values()}) == 1
    assert "| llama.cpp, 1 thread | 2 |" in proc.stdout and "### Bytes read per decode step" in proc.stdout
