"""The MQAR testbed (jaxkv.research.mqar): its data layout, training to >= 95% recall with configs/mqar.yaml,
the checkpoint round trip, and evaluation through quantized and evicting caches with the errors traced.

The trained model is shared by every test (module fixture); training takes about 1-1.5 minutes here."""

import json
from pathlib import Path

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.cli.main import main
from jaxkv.config import load_config
from jaxkv.research.mqar import (
    CHECKPOINT_FILE, CONFIG_FILE, LOSS_PLOT_FILE, METRICS_FILE, DataConfig, MQARConfig, evaluate, forward,
    load_checkpoint, mqar_batch, train,
)  # fmt: skip
from jaxkv.eviction import EvictionSpec
from jaxkv.quantization import QuantSpec

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "mqar.yaml"


def test_batch_layout_targets_are_the_values_of_the_queried_keys():
    data = DataConfig(num_pairs=6, num_queries=4, num_keys=10, num_values=5)
    batch = mqar_batch(data, 32, np.random.default_rng(0))
    context = data.context_length
    assert batch.tokens.shape == batch.targets.shape == batch.mask.shape == (32, 16)
    keys, values = batch.tokens[:, 0:context:2], batch.tokens[:, 1:context:2]
    assert ((keys >= 0) & (keys < 10)).all() and ((values >= 10) & (values < 15)).all()
    assert all(len(set(row)) == 6 for row in keys.tolist())  # distinct keys per row
    assert not batch.mask[:, :context].any() and batch.mask[:, context:].all()
    for row in range(32):
        value_of = dict(zip(keys[row].tolist(), values[row].tolist()))
        queries = batch.tokens[row, context:].tolist()
        assert len(set(queries)) == 4 and set(queries) <= set(value_of)
        assert batch.targets[row, context:].tolist() == [value_of[key] for key in queries]
        pairs = batch.query_pairs[row]
        assert queries == keys[row, pairs].tolist()  # pair p: key at 2p, value at 2p + 1
        assert batch.targets[row, context:].tolist() == batch.tokens[row, 2 * pairs + 1].tolist()
    again = mqar_batch(data, 32, np.random.default_rng(0))
    chex.assert_trees_all_equal(again.tokens, batch.tokens)


def test_config_refuses_more_queries_than_pairs():
    with pytest.raises(ValueError, match="num_queries"):
        DataConfig(num_pairs=4, num_queries=5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    output = tmp_path_factory.mktemp("mqar")
    return train(load_config(CONFIG, MQARConfig), output, progress=False)


def test_training_reaches_95_percent_recall_and_saves_its_outputs(trained):
    assert trained.recall >= 0.95
    assert np.mean(trained.losses[-20:]) < 0.1 * np.mean(trained.losses[:20])
    for name in (CHECKPOINT_FILE, CONFIG_FILE, LOSS_PLOT_FILE, METRICS_FILE):
        assert (trained.output / name).is_file()
    assert (trained.output / LOSS_PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((trained.output / METRICS_FILE).read_text())["recall"] == trained.recall


def test_checkpoint_round_trip_predicts_identically(trained):
    loaded = load_checkpoint(trained.output)
    assert loaded.config == trained.model.config
    batch = mqar_batch(loaded.config.data, 8, np.random.default_rng(5))
    positions = jnp.broadcast_to(jnp.arange(batch.tokens.shape[1]), batch.tokens.shape)

    def logits(model):
        graphdef, state = nnx.split(model.decoder)
        cache = model.decoder.init_cache(8, batch.tokens.shape[1])
        return forward(graphdef, state, batch.tokens, positions, cache)[0]

    chex.assert_trees_all_equal(logits(loaded), logits(trained.model))


def test_missing_checkpoint_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-mqar"):
        load_checkpoint(tmp_path)


def test_evaluate_full_and_int8_caches(trained):
    full = evaluate(trained.model, 256, seed=7, cache_kwargs={})
    head_dim = trained.model.decoder.config.dim_per_head
    int8 = QuantSpec(nbits=8, q_group_size=head_dim, residual_length=0)  # every token quantized
    quantized = evaluate(trained.model, 256, seed=7, cache_kwargs={"quantization": int8})
    assert full["accuracy"] >= 0.95 and quantized["accuracy"] >= full["accuracy"] - 0.02
    assert quantized["kv_bytes"] < 0.5 * full["kv_bytes"]
    for result in (full, quantized):
        assert result["num_queries"] == 256 * 16
        assert result["evicted_fraction"] == 0  # nothing evicts: every error is the model's
        assert result["num_errors"] == 0 or result["errors_present"] == 1.0


def test_evaluate_with_eviction_traces_errors_to_evicted_tokens(trained):
    full = evaluate(trained.model, 256, seed=7, cache_kwargs={})
    # A quarter of the 32-token context: StreamingLLM keeps the 4 sinks (pairs 0-1) and the 4 most
    # recent positions (pairs 14-15), so the value of 12 of the 16 pairs is gone from every head.
    spec = EvictionSpec("streaming_llm", budget=8)
    evicted = evaluate(trained.model, 256, seed=7, cache_kwargs={"eviction": spec})
    assert evicted["evicted_fraction"] == pytest.approx(12 / 16)
    assert evicted["accuracy"] < 0.5 < full["accuracy"]
    assert evicted["kv_bytes"] < 0.5 * full["kv_bytes"]
    assert evicted["errors_evicted"] + evicted["errors_present"] == pytest.approx(1.0)
    assert evicted["errors_evicted"] > 0.9  # the errors are the dropped pairs'
    assert evicted["accuracy_present"] > 0.9 > evicted["accuracy_evicted"] + 0.5


def test_cli_trains_the_config_it_is_given(trained, tmp_path, capsys, monkeypatch):
    calls = []

    def fake_train(config, output):  # the training itself is the fixture's; this checks the command's wiring
        calls.append((config, output))
        return trained

    monkeypatch.setattr("jaxkv.research.mqar.train", fake_train)
    assert main(["train-mqar", str(CONFIG), "--output", str(tmp_path)]) == 0
    assert calls == [(load_config(CONFIG, MQARConfig), tmp_path)]
    assert f"recall {trained.recall:.4f}" in capsys.readouterr().err


def test_cli_names_a_bad_config_key(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("data: {num_pairs: 4, num_queries: 5}\n")
    assert main(["train-mqar", str(config)]) == 2
    assert "num_queries" in capsys.readouterr().err
