"""``jaxkv generate --mesh`` and the YAML ``mesh:`` section: sharded runs give the same tokens,
and every bad mesh or multi-process flag is one clear error line (no traceback).

The test process has 8 CPU devices (tests/conftest.py). The model is a tiny random Llama saved
as a transformers checkpoint with a word-level tokenizer: 4 query and 2 K/V heads, so a
``model`` axis of 4 replicates the K/V heads (with a warning)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers

from jaxkv.cli.generate import resolve_config
from jaxkv.cli.main import build_parser, main
from jaxkv.cli.serve import resolve_serve_config
from jaxkv.config import ConfigError, MeshConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WORDS = ["[UNK]", "</s>"] + [f"w{i}" for i in range(62)]
PROMPTS = ["w3 w4 w5", "w9 w10"]
KV_WARNING = "kv_heads (2) is not divisible by mesh axis 'model' of size 4"


def save_tiny_checkpoint(directory: Path) -> Path:
    """A random 2-layer Llama (vocabulary ``WORDS``, ``</s>`` its stop token) and its tokenizer,
    as ``jaxkv generate --model DIRECTORY`` reads them. Weights drawn wide (std 0.5) so greedy
    choices are not near ties that a sharded sum could flip."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = tokenizers.models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(vocab)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    config = transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, initializer_range=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def generate_argv(checkpoint: Path, *more: str, prompts=PROMPTS) -> list[str]:
    prompt_flags = [flag for prompt in prompts for flag in ("--prompt", prompt)]
    return ["generate", "--model", str(checkpoint), "--no-chat", *prompt_flags, "--max-new-tokens", "6", *more]


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxkv: error: "), err
    return lines[0]


def test_mesh_gives_the_same_tokens_and_warns_once(checkpoint, capsys):
    """Sharded in a fresh process (the warning is given once per process) against this one unsharded."""
    code, plain, err = run(capsys, generate_argv(checkpoint))
    assert code == 0, err
    assert plain.count("--- prompt") == 2 and "2 prompts" in err
    sharded = subprocess.run(
        [sys.executable, "-m", "jaxkv.cli", *generate_argv(checkpoint, "--mesh", "data=2,model=4")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_NUM_CPU_DEVICES": "8"}, check=False,
    )  # fmt: skip
    assert sharded.returncode == 0, sharded.stderr
    assert sharded.stdout == plain
    assert sharded.stderr.count(f"jaxkv: warning: {KV_WARNING}") == 1


@pytest.mark.parametrize(
    ("mesh", "prompts", "message"),
    [
        ("data=x", PROMPTS, "expected comma-separated axis=size"),
        ("data=2,data=4", PROMPTS, "axis 'data' is given twice"),
        ("dta=2,model=4", PROMPTS, "--mesh dta=2,model=4: dta: Extra inputs are not permitted"),
        ("data=2,model=8", PROMPTS, "has 16 devices but 8 are available"),
        ("data=2,model=4", PROMPTS[:1], "splits the batch rows, one per prompt, but there are 1"),
    ],
)
def test_bad_meshes_are_one_line_errors(checkpoint, capsys, mesh, prompts, message):
    code, out, err = run(capsys, generate_argv(checkpoint, "--mesh", mesh, prompts=prompts))
    assert code == 2 and not out
    assert message in one_error_line(err)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-processes", "2"], "needs all of --coordinator HOST:PORT, --num-processes N and --process-id I"),
        (["--coordinator", "127.0.0.1", "--num-processes", "2", "--process-id", "0"], "expected HOST:PORT"),
        (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], "give 0 to 1"),
        (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1"], "give --mesh"),
        (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0", "--mesh", "data=2,model=4",
          "--stream"], "--stream"),
    ],
)  # fmt: skip
def test_multi_process_flag_errors_come_before_joining(checkpoint, capsys, flags, message):
    """Each is refused before ``jax.distributed`` would wait for a coordinator."""
    code, out, err = run(capsys, generate_argv(checkpoint, *flags, prompts=PROMPTS[:1] * 2))
    assert code == 2 and not out
    assert message in one_error_line(err)


def test_stream_takes_one_prompt(checkpoint, capsys):
    code, _, err = run(capsys, generate_argv(checkpoint, "--stream"))
    assert code == 2 and "give one --prompt" in one_error_line(err)


def resolved(*argv: str):
    return resolve_config(build_parser().parse_args(["generate", *argv]))


def test_yaml_mesh_section_and_the_flag_on_top(tmp_path):
    config = tmp_path / "mesh.yaml"
    config.write_text("prompt: [a, b]\nmesh: {data: 2, model: 4}\n")
    assert resolved("--config", str(config)).mesh.shape() == {"data": 2, "model": 4}
    assert resolved("--config", str(config), "--mesh", "model=8").mesh == MeshConfig(model=8)
    assert resolved().mesh is None and resolved("--prompt", "x").prompts == ["x"]


@pytest.mark.parametrize(
    ("section", "named"),
    [("{data: 2, modle: 4}", "mesh.modle"), ("{data: 0}", "mesh.data"), ("{data: '2'}", "mesh.data"),
     ("4", "mesh")],
)  # fmt: skip
def test_yaml_mesh_errors_name_the_key_and_file(tmp_path, capsys, section, named):
    config = tmp_path / "bad-mesh.yaml"
    config.write_text(f"mesh: {section}\n")
    with pytest.raises(ConfigError, match=named):
        resolved("--config", str(config))
    code, _, err = run(capsys, ["generate", "--config", str(config)])
    assert code == 2 and "bad-mesh.yaml" in one_error_line(err) and named in err


def test_serve_mesh_from_the_file_and_the_flag(tmp_path, capsys):
    parse = build_parser().parse_args
    config = tmp_path / "serve.yaml"
    config.write_text((CONFIGS / "serve.yaml").read_text() + "mesh:\n  model: 8\n")
    assert resolve_serve_config(parse(["serve", "--config", str(config)])).mesh == MeshConfig(model=8)
    flagged = resolve_serve_config(parse(["serve", "--config", str(config), "--mesh", "data=2,model=4"]))
    assert flagged.mesh == MeshConfig(data=2, model=4)
    config.write_text("mesh: {data: 2, tensor: 4}\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "mesh.tensor" in one_error_line(capsys.readouterr().err)


def test_shipped_mesh_config():
    config = resolved("--config", str(CONFIGS / "smollm2-mesh.yaml"))
    assert config.mesh == MeshConfig(data=2, model=4) and len(config.prompts) % config.mesh.data == 0
