"""``jaxkv experiment``: config validation, the cell listing and the tasks' prompts (needle depth,
fitting, answer parsing). The smoke grid end to end on SmolLM2: test_experiment_smoke.py."""

import dataclasses
import json
import re
from pathlib import Path

import chex
import numpy as np
import pytest

from jaxkv.cli.main import main
from jaxkv.config import ConfigError, load_config
from jaxkv.research.experiment import Cell, ExperimentConfig, grid
from jaxkv.research.tasks import (
    PASSKEY,
    ContextPrefills,
    Haystack,
    KVRetrievalTask,
    PasskeyTask,
    kv_retrieval_examples,
    parse_number,
    passkey_examples,
    perplexity_through_cache,
    perplexity_windows,
    split_prompt,
)

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "configs" / "experiments"
GRID = {
    "models": ["smollm2"],
    "tasks": [{"kind": "passkey", "contexts": [256]}],
    "caches": [{"name": "full"}, {"name": "snapkv", "eviction": {"policy": "snapkv", "window": 16}}],
    "budgets": [1.0, 0.5],
}


def validate(**changes) -> ExperimentConfig:
    return ExperimentConfig.model_validate(GRID | changes)


@pytest.fixture(scope="module")
def tokenizer():
    from jaxkv.models.load import Pretrained

    return Pretrained("smollm2").tokenizer(required=True)


@pytest.fixture(scope="module")
def haystack(tokenizer):
    return Haystack.build(tokenizer)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"seed": [0]}, "seed"),  # a typo of seeds
        ({"caches": [{"name": "full", "quantisation": {"nbits": 8}}]}, "caches.0.quantisation"),
        ({"caches": [{"name": "x", "eviction": {"policy": "lru"}}]}, "caches.0.eviction: Value error, EvictionSpec: unknown policy 'lru'"),
        ({"tasks": [{"kind": "needle", "contexts": [256]}]}, "tasks.0"),
        ({"tasks": [{"kind": "passkey", "depths": [1.5]}]}, "tasks.0.passkey.depths.0"),
        ({"budgets": [0.0]}, "budgets.0"),
        (
            {"caches": [{"name": "full"}, {"name": "full", "quantization": {"nbits": 8}}]},
            "cache names must be distinct",
        ),
        ({"caches": [{"name": "q", "quantization": {"nbits": 8}, "eviction": {"policy": "h2o"}}]}, "not quantization and eviction"),
        ({"caches": [{"name": "full"}]}, "budgets below 1.0 apply to eviction caches"),
        ({"caches": [{"name": "snapkv", "eviction": {"policy": "snapkv", "window": 16}}]}, "add a plain cache"),
        (
            {"caches": [{"name": "full"}, {"name": "s", "eviction": {"policy": "snapkv"}}], "budgets": [0.125]},
            "cache 's' at budget 0.125 of 256",  # 32 slots, less than SnapKV's window of 64
        ),
        ({"tasks": [{"kind": "perplexity", "contexts": [200]}]}, "not a multiple of chunk"),
    ],
)
def test_config_errors_name_the_field(tmp_path, changes, message):
    """Each mistake is a ConfigError naming the file and the field (or the rule broken)."""
    path = tmp_path / "grid.yaml"
    path.write_text(json.dumps(GRID | changes))  # JSON is YAML
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        load_config(path, ExperimentConfig)
    assert str(path) in str(error.value)


def test_grid_runs_budget_one_once_and_orders_cells_by_model():
    """Plain and quantized caches run once; an eviction cache once per budget below 1.0 (1.0 of
    a policy is the plain cache's cell); cells go model by model, seeds of one cache together."""
    config = validate(
        models=["smollm2", "gemma3"], seeds=[0, 1], budgets=[1.0, 0.5, 0.25],
        caches=[GRID["caches"][0], {"name": "int8", "quantization": {"nbits": 8}}, GRID["caches"][1]],
    )  # fmt: skip
    cells = grid(config)
    assert len(cells) == 2 * (1 + 1 + 2) * 2
    assert cells[:4] == [
        Cell("smollm2", "passkey", 256, "full", 1.0, 0),
        Cell("smollm2", "passkey", 256, "full", 1.0, 1),
        Cell("smollm2", "passkey", 256, "int8", 1.0, 0),
        Cell("smollm2", "passkey", 256, "int8", 1.0, 1),
    ]
    assert [c.budget for c in cells if c.cache == "snapkv" and c.model == "gemma3"] == [0.5, 0.5, 0.25, 0.25]
    assert {c.model for c in cells[: len(cells) // 2]} == {"smollm2"}


def test_a_run_orders_cells_by_cache_shape_across_grids(tmp_path):
    """A run goes model by model, then cache by cache (one setting in two grids is one cache), each
    by capacity: cells of one compiled shape run in a row, whatever their grid, task or context."""
    from jaxkv.research.experiment import shape_order

    caches = [GRID["caches"][0], {"name": "int8", "quantization": {"nbits": 8}}, GRID["caches"][1]]
    short = validate(models=["smollm2", "gemma3"], budgets=[1.0, 0.5, 0.25], caches=caches,
                     tasks=[{"kind": "passkey", "contexts": [1024]}])  # fmt: skip
    long = validate(budgets=[1.0, 0.5, 0.25], caches=caches, tasks=[{"kind": "kv_retrieval", "contexts": [2048]}])
    grids = [(short, tmp_path / "short"), (long, tmp_path / "long")]
    cells = [(index, cell) for index, (config, _) in enumerate(grids) for cell in grid(config)]
    ordered = [(index, cell.model, cell.cache, cell.context, cell.budget) for index, cell in shape_order(grids, cells)]
    assert ordered == [
        (0, "smollm2", "full", 1024, 1.0), (1, "smollm2", "full", 2048, 1.0),
        (0, "smollm2", "int8", 1024, 1.0), (1, "smollm2", "int8", 2048, 1.0),
        (0, "smollm2", "snapkv", 1024, 0.25),  # 256 slots
        (0, "smollm2", "snapkv", 1024, 0.5), (1, "smollm2", "snapkv", 2048, 0.25),  # 512 slots
        (1, "smollm2", "snapkv", 2048, 0.5),  # 1024 slots
        (0, "gemma3", "full", 1024, 1.0), (0, "gemma3", "int8", 1024, 1.0),
        (0, "gemma3", "snapkv", 1024, 0.25), (0, "gemma3", "snapkv", 1024, 0.5),
    ]  # fmt: skip


def test_budget_fractions_become_slots():
    snapkv = validate().caches[1]
    assert snapkv.options(0.5, 1024)["eviction"].budget == 512
    assert snapkv.options(1.0, 1024) == {}
    int8 = validate(caches=[GRID["caches"][0], {"name": "int8", "quantization": {"nbits": 8}}], budgets=[1.0])
    assert int8.caches[1].options(1.0, 1024)["quantization"].bits == 8


def test_shipped_grids_validate():
    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        assert grid(load_config(path, ExperimentConfig)), path


def test_dry_run_lists_the_cells(capsys, tmp_path):
    code = main(["experiment", str(EXPERIMENTS / "smoke.yaml"), "--dry-run", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "todo  smollm2 passkey 256 full seed 0" in out
    assert "todo  smollm2 perplexity 256 snapkv@0.25 seed 0" in out
    assert out.strip().endswith(f"12 cells, 12 to run, results in {tmp_path / 'smoke'}")
    assert not (tmp_path / "smoke").exists()  # nothing run, nothing written


def test_one_command_takes_several_grids_and_validates_them_all_first(capsys, tmp_path):
    """``jaxkv experiment A.yaml B.yaml`` lists (or runs) both grids; a config error in the last one
    stops the command before the first grid runs a cell."""
    smoke, passkey = str(EXPERIMENTS / "smoke.yaml"), str(EXPERIMENTS / "passkey.yaml")
    assert main(["experiment", smoke, passkey, "--dry-run", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"results in {tmp_path / 'smoke'}" in out and f"results in {tmp_path / 'passkey'}" in out
    bad = tmp_path / "typo.yaml"
    bad.write_text(json.dumps(GRID | {"seed": [0]}))
    assert main(["experiment", smoke, str(bad), "--output-dir", str(tmp_path)]) == 2
    assert "seed" in capsys.readouterr().err and not (tmp_path / "smoke").exists()


def test_a_cell_whose_settings_changed_runs_again(tmp_path):
    """A results line counts as done only for the task and cache settings it ran with."""
    from jaxkv.research.experiment import cell_settings, list_cells

    config = validate(budgets=[1.0])
    (cell,) = [c for c in grid(config) if c.cache == "full"]
    line = {**dataclasses.asdict(cell), "settings": cell_settings(config, cell)}
    (tmp_path / "results.jsonl").write_text(json.dumps(line) + "\n")
    assert list_cells(config, tmp_path).startswith("done  smollm2 passkey 256 full seed 0")
    deeper = validate(budgets=[1.0], tasks=[{"kind": "passkey", "contexts": [256], "depths": [0.9]}])
    assert list_cells(deeper, tmp_path).startswith("todo  smollm2 passkey 256 full seed 0")


def test_haystack_puts_needles_at_the_nearest_sentence_boundary():
    """Ten sentences of 10 tokens: depth 0.3 lands after three of them, 0 first, 1 last, and two
    needles at one boundary keep their order."""
    haystack = Haystack(tuple(f"S{i}." for i in range(10)), np.full(10, 10))
    filled = haystack.fill(2, 100, [(0.3, "N1."), (0.0, "N0."), (1.0, "N9."), (0.31, "N2.")])
    assert filled.text == "N0. S2. S3. S4. N1. N2. S5. S6. S7. S8. S9. S0. S1. N9."
    assert filled.depths == (0.3, 0.0, 1.0, 0.3)
    assert haystack.fill(0, 35, []).text == "S0. S1. S2."  # at most 35 tokens


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_passkey_needle_is_at_the_requested_depth(tokenizer, haystack, depth):
    """In the token ids the key's digits sit within 5% of the haystack from the requested depth;
    the prompt leaves room for the answer, uses the chat template and ends on the answer's start."""
    task = PasskeyTask(kind="passkey", contexts=[2048], depths=[depth], max_new_tokens=8)
    (example,) = passkey_examples(task, tokenizer, True, haystack, 2048, seed=3)
    assert len(example.context) + len(example.question) <= 2048 - 8
    assert len(example.context) + len(example.question) > 2048 - 8 - 100  # the haystack fills the context
    assert tokenizer.decode(example.context, skip_special_tokens=False).startswith("<|im_start|>system")
    assert tokenizer.decode(example.question).endswith("The pass key is:")
    opening = len(split_prompt(tokenizer, True, PASSKEY, "")[0]) - 1  # the empty haystack's context, less its "\n\n"
    digits = tokenizer.encode(example.answer, add_special_tokens=False)
    found = [i for i in range(len(example.context)) if example.context[i : i + len(digits)] == digits]
    haystack_tokens = len(example.context) - opening
    assert abs((found[0] - opening) / haystack_tokens - depth) < 0.05
    assert abs(example.placed_depth - depth) < 0.05
    assert re.fullmatch(r"\d{5}", example.answer)


def test_examples_are_seeded(tokenizer, haystack):
    task = PasskeyTask(kind="passkey", contexts=[512], depths=[0.5], examples=2)
    first = passkey_examples(task, tokenizer, True, haystack, 512, seed=0)
    assert first == passkey_examples(task, tokenizer, True, haystack, 512, seed=0)
    assert first[0].answer != first[1].answer
    assert [e.answer for e in passkey_examples(task, tokenizer, True, haystack, 512, seed=1)] != [
        e.answer for e in first
    ]


def test_kv_retrieval_asks_one_of_its_facts(tokenizer, haystack):
    task = KVRetrievalTask(kind="kv_retrieval", contexts=[1024], depths=[0.2, 0.8], facts=5)
    for example in kv_retrieval_examples(task, tokenizer, False, haystack, 1024, seed=0):
        context, question = tokenizer.decode(example.context), tokenizer.decode(example.question)
        facts = dict(re.findall(r"The special magic number for (\w+) is: (\d+)\.", context))
        assert len(facts) == 5
        (asked,) = re.findall(r"What is the special magic number for (\w+)\?", question)
        assert facts[asked] == example.answer
        assert question.endswith(f"The special magic number for {asked} is:")
        assert abs(example.placed_depth - example.depth) < 0.1


@pytest.mark.parametrize(
    ("text", "number"), [(" 12345.", "12345"), (" 4 5", "4"), (": 007", "007"), (" unknown", None), ("", None)]
)
def test_answers_parse_to_their_first_number(text, number):
    assert parse_number(text) == number


def test_perplexity_windows_are_seeded_and_batched():
    """Seed s reads the windows after seed s - 1's; a corpus too short is an error naming the fix;
    windows batched as rows score as each alone. (Chunked feeding against one forward, and int8:
    tests/layers/test_quantized.py.)"""
    from jaxkv.models.llama import Llama, LlamaConfig

    ids = np.arange(20, dtype=np.int32)
    np.testing.assert_array_equal(perplexity_windows(ids, 4, 2, seed=1), [[10, 11, 12, 13, 14], [15, 16, 17, 18, 19]])
    with pytest.raises(ValueError, match="fewer windows"):
        perplexity_windows(ids, 4, 2, seed=2)
    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = Llama(config, seed=5)
    windows = np.random.default_rng(0).integers(0, 50, (2, 17)).astype(np.int32)
    both, _ = perplexity_through_cache(model, windows, 8, {})
    first, _ = perplexity_through_cache(model, windows[:1], 8, {})
    second, _ = perplexity_through_cache(model, windows[1:], 8, {})
    np.testing.assert_allclose(both, [first[0], second[0]], rtol=1e-5)


def test_mqar_cells_run_on_their_checkpoint(tmp_path):
    """An mqar task runs on its checkpoint (not on the grid's models), its budgets are fractions of
    the checkpoint's context, and its cells carry evaluate's error attribution. The model is
    untrained: this checks the plumbing, jaxkv.research.mqar's tests check recall."""
    from jaxkv.research.experiment import run_experiment
    from jaxkv.research.mqar import MQARConfig, RecallModel, build_decoder, save_checkpoint

    mqar = MQARConfig.model_validate({"data": {"num_pairs": 8, "num_queries": 4, "num_keys": 16, "num_values": 16}})
    save_checkpoint(RecallModel(build_decoder(mqar), mqar), tmp_path / "mqar")
    config = ExperimentConfig.model_validate({
        "models": ["smollm2"], "budgets": [0.5],
        "tasks": [{"kind": "mqar", "checkpoint": str(tmp_path / "mqar"), "examples": 8, "batch_size": 8}],
        "caches": [{"name": "full"}, {"name": "key_norm", "eviction": {"policy": "key_norm"}}],
    })  # fmt: skip
    assert grid(config) == [
        Cell(str(tmp_path / "mqar"), "mqar", 16, "full", 1.0, 0),
        Cell(str(tmp_path / "mqar"), "mqar", 16, "key_norm", 0.5, 0),
    ]
    rows = run_experiment(config, tmp_path / "grid", progress=False)
    held = {r["cache"]: r for r in rows}
    assert held["key_norm"]["kv_bytes"] < held["full"]["kv_bytes"]
    lines = [json.loads(line) for line in (tmp_path / "grid" / "results.jsonl").read_text().splitlines()]
    assert {line["cache"]: line["metrics"]["evicted_fraction"] for line in lines}["full"] == 0.0


def test_pyramidkv_plans_for_the_mqar_context_not_the_cache():
    """MQAR compresses its 32-token context before the 16 queries (a 48-token cache): its
    PyramidKV cells plan for the context, as kvpress does ([30, 2] at half of it, not SnapKV's
    uniform 16 that the cache's length gives); the retrieval prompts differ in length per row, so
    their cells plan for the cache's length."""
    from jaxkv.research.experiment import cell_options

    pyramid = {"name": "pyramidkv", "eviction": {"policy": "pyramidkv", "window": 2, "kernel_size": 3}}
    config = ExperimentConfig.model_validate({
        "models": ["smollm2"], "budgets": [0.5],
        "tasks": [{"kind": "mqar", "checkpoint": "absent", "train_config": str(ROOT / "configs" / "mqar.yaml")},
                  {"kind": "passkey", "contexts": [256]}],
        "caches": [pyramid, {"name": "snapkv", "eviction": {"policy": "snapkv", "window": 2}}],
    })  # fmt: skip
    spec = cell_options(config, Cell("absent", "mqar", 32, "pyramidkv", 0.5, 0))["eviction"]
    assert (spec.budget, spec.prompt_length) == (16, 32)
    assert spec.resolved(48).layer_budgets(2) == [30, 2]
    assert cell_options(config, Cell("smollm2", "passkey", 256, "pyramidkv", 0.5, 0))["eviction"].prompt_length is None
    assert cell_options(config, Cell("absent", "mqar", 32, "snapkv", 0.5, 0))["eviction"].prompt_length is None


def test_mqar_without_a_checkpoint_names_the_training_command(tmp_path):
    with pytest.raises(ValueError, match="jaxkv train-mqar"):
        ExperimentConfig.model_validate(GRID | {"tasks": [{"kind": "mqar", "checkpoint": str(tmp_path / "none")}]})


def test_every_cache_of_a_context_shares_one_prefill(monkeypatch):
    """Each batch of contexts is prefilled once, into an Observer cache, and every cell's cache is
    refilled from it: each policy at each budget equals prefilling at that budget, the plain cache
    equals the plain prefill; another seed, context or SnapKV window prefills again, an earlier
    one does not."""
    from jaxkv.models.llama import Llama, LlamaConfig

    import jaxkv.decoding.generate
    from jaxkv.eviction import EvictionSpec
    from jaxkv.quantization import QuantSpec
    from jaxkv.research.observer import Observer
    from jaxkv.research.tasks import PREFILL_CHUNK
    from tests.cases import TINY_LLAMA

    model, contexts = Llama(LlamaConfig(**TINY_LLAMA), seed=0), [[3, 14, 15, 9, 2, 6, 5, 3, 5, 8], [35, 8, 9]]
    direct = jaxkv.decoding.generate.prefill_prefix
    calls = []
    monkeypatch.setattr(jaxkv.decoding.generate, "prefill_prefix", lambda *a, **k: calls.append(k) or direct(*a, **k))
    prefills = ContextPrefills()
    plain = prefills.cache(model, contexts, 16, (0, 0), {})
    chex.assert_trees_all_close(plain, direct(model, contexts, max_length=16), atol=1e-6)
    quantized = prefills.cache(model, contexts, 16, (0, 0), {"quantization": QuantSpec(nbits=8, q_group_size=8)})
    assert type(quantized.layer(0)).__name__ == "QuantizedLayer"
    for spec in [EvictionSpec("h2o", budget=b, window=2) for b in (8, 6, 4)] + [EvictionSpec("key_norm", budget=4)]:
        got = prefills.cache(model, contexts, 16, (0, 0), {"eviction": spec})
        want = direct(model, contexts, max_length=16, eviction=spec)
        for a, b in zip(got.layers, want.layers):
            np.testing.assert_array_equal(a.slot_positions, b.slot_positions)
            np.testing.assert_allclose(a.keys, b.keys, atol=1e-6)
    assert calls == [{"max_length": 16, "chunk": PREFILL_CHUNK, "layer_builder": Observer()}]
    prefills.cache(model, contexts, 16, (1, 0), {})  # another seed
    prefills.cache(model, contexts, 12, (1, 0), {})  # another context
    prefills.cache(model, contexts, 12, (1, 0), {"eviction": EvictionSpec("snapkv", budget=4, window=3)})
    assert [k["layer_builder"] for k in calls[1:]] == [Observer(), Observer(), Observer(3)]
    prefills.cache(model, contexts, 16, (0, 0), {"quantization": QuantSpec(nbits=4, q_group_size=8)})
    assert len(calls) == 4  # every context's prefill is kept: an earlier context prefills no more


def test_readme_config_example_validates():
    import yaml

    readme = (ROOT / "docs" / "eviction-and-experiments.md").read_text()
    example = re.search(r"## Experiments.*?```yaml\n(.*?)```", readme, re.S).group(1)
    config = ExperimentConfig.model_validate(yaml.safe_load(example))
    assert {c.kind for c in config.caches} == {"full", "quantized", "eviction"}


def test_compile_cache_sets_jaxs_persistent_cache_for_the_run(monkeypatch, tmp_path):
    """``--compile-cache DIR`` points JAX's persistent compilation cache there before the grids
    run (not for a dry run, and not without the flag); the grids get the same arguments."""
    import jax

    import jaxkv.research.experiment

    updates, runs = [], []
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
    monkeypatch.setattr(jaxkv.research.experiment, "run_command", lambda *a, **k: runs.append((a, k)) or 0)
    smoke = str(EXPERIMENTS / "smoke.yaml")
    assert main(["experiment", smoke, "--compile-cache", str(tmp_path / "cc"), "--output-dir", str(tmp_path)]) == 0
    assert updates == [("jax_compilation_cache_dir", str(tmp_path / "cc"))]
    assert main(["experiment", smoke, "--compile-cache", str(tmp_path / "cc"), "--dry-run"]) == 0
    assert main(["experiment", smoke]) == 0
    assert len(updates) == 1 and [k["dry_run"] for _, k in runs] == [False, True, False]
