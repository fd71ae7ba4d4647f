"""``scripts/compaction_accuracy.py`` (``jaxkv.bench.compaction_accuracy``) on a tiny random Llama
with SmolLM2's tokenizer: the engine's answers are the runner's with full K/V and with a budget
the prompt fits in, every row scored alike; the table."""

import pytest
from jaxkv.models.llama import Llama, LlamaConfig

from jaxkv.bench import compaction_accuracy
from jaxkv.research.tasks import RetrievalExample


def measured(*options: str) -> list[dict]:
    from jaxkv.models.load import Pretrained

    tokenizer = Pretrained("smollm2").tokenizer(required=True)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=1024)  # fmt: skip  SmolLM2's vocabulary
    args = compaction_accuracy.parse_args(["--context", "160", "--depths", "0.5", "--examples", "2", "--batch-size",
                                           "2", "--kv-memory", "4MiB", *options])  # fmt: skip
    return compaction_accuracy.measure(args, Llama(config, seed=0), tokenizer)


@pytest.fixture(scope="module")
def rows():
    return measured("--pages", "11", "3")


def test_snapkv_is_compared_with_generate_over_the_whole_prompts():
    """``--policy snapkv``: the EvictingLayer row is ``generate`` over context + question; with a
    budget the prompt fits in, both sides answer as full K/V; at 6 pages (80 tokens of 160) the
    engine compacts the prompt once and its answers change."""
    full_runner, full_engine, evicting_11, engine_11, evicting_6, engine_6 = measured(
        "--pages", "11", "6", "--policy", "snapkv"
    )
    assert [r["system"] for r in (evicting_11, engine_11)] == [
        "EvictingLayer snapkv (generate, whole prompt)",
        "engine snapkv, choice per pool",
    ]
    assert evicting_11["outputs"] == engine_11["outputs"] == full_engine["outputs"] == full_runner["outputs"]
    assert engine_6["outputs"] != full_engine["outputs"] and evicting_6["outputs"] != full_engine["outputs"]


def test_the_engine_answers_as_the_runner_with_full_kv_and_a_budget_the_prompt_fits(rows):
    full_runner, full_engine, evicting_11, engine_11, evicting_3, engine_3 = rows
    assert [r["system"] for r in rows[:2]] == ["full K/V (runner)", "full K/V (engine)"]
    assert [(r["pages"], r["system"]) for r in rows[2:4]] == [(11, "EvictingLayer streaming_llm (runner)"),
                                                               (11, "engine streaming_llm, choice per pool")]  # fmt: skip
    # 160 tokens fit in 10 pages of 16: nothing is evicted or compacted
    assert full_engine["outputs"] == full_runner["outputs"] == engine_11["outputs"] == evicting_11["outputs"]
    assert all(r["num_examples"] == 2 and set(r["accuracy_by_depth"]) == {"0.5"} for r in rows)
    assert engine_3["outputs"] != full_engine["outputs"]  # 32 of 160 tokens kept: the answers change


def test_scored_as_the_runner_scores():
    examples = [RetrievalExample([1], [2], "12345", 0.1, 0.1), RetrievalExample([1], [2], "54321", 0.9, 0.9)]
    metrics = compaction_accuracy.scored(examples, [" 12345.", "5432 1"])
    assert metrics["accuracy"] == 0.5 and metrics["accuracy_by_depth"] == {"0.1": 1.0, "0.9": 0.0}


def test_the_table_and_the_arguments(rows):
    table = compaction_accuracy.markdown(rows, 16)
    assert "| engine streaming_llm, choice per pool | 3 | 32 |" in table and "| full K/V (runner) | - | all |" in table
    with pytest.raises(SystemExit):
        compaction_accuracy.parse_args(["--pages", "1"])
