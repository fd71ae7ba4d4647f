"""The toy decoder through every cache kind equals the same model without a cache."""

import functools
import subprocess
import sys
from pathlib import Path

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import Cache
from jaxkv.config import CacheConfig, ConfigError, load_config
from jaxkv.models.toy import ToyConfig, ToyDecoder

ROOT = Path(__file__).resolve().parents[2]


def forward(graphdef, state, tokens, positions, cache):
    return nnx.merge(graphdef, state)(tokens, positions, cache)


LENGTHS = [19, 12]  # ragged rows


@functools.cache
def uncached(repeats: int):
    """The toy decoder with ``repeats`` copies of its layer pattern (every layer kind in each), its
    tokens ``[2, 19]`` and their logits ``[2, 19, V]`` without a cache, computed once for the
    variants that share them. One batched call: attention is causal, so row 1's first 12
    logits are those of its 12 tokens alone."""
    config = ToyConfig(layer_types=ToyConfig().layer_types * repeats)
    model = ToyDecoder(config, nnx.Rngs(1))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(2, max(LENGTHS)))
    positions = jnp.broadcast_to(jnp.arange(max(LENGTHS)), tokens.shape)
    return config, model, tokens, np.asarray(model(jnp.asarray(tokens), positions)[0])


class ToyDecoderCachedEqualsUncached(chex.TestCase):
    def check(self, full_attention, rollback_slots, stacked=False):
        # One pattern holds every layer kind; a stacked cache gets two repeats, so that it really stacks.
        config, model, tokens, full = uncached(2 if stacked else 1)
        graphdef, state = nnx.split(model)
        step = self.variant(forward, static_argnums=0)
        cache = Cache.from_config(
            config, 2, max_length=32, full_attention=full_attention, rollback_slots=rollback_slots, stacked=stacked
        )
        fed = np.zeros(2, int)
        for width in (7, 1, 3, 1, 8, 1):
            counts = np.minimum(width, np.asarray(LENGTHS) - fed)
            positions = np.asarray(cache.next_positions(width, num_new=counts))
            chunk = np.zeros((2, width), int)
            for r in range(2):
                chunk[r, : counts[r]] = tokens[r, fed[r] : fed[r] + counts[r]]
            cache = cache.reserve(width)
            logits, cache = step(graphdef, state, jnp.asarray(chunk), jnp.asarray(positions), cache)
            for r in range(2):
                want = full[r][fed[r] : fed[r] + counts[r]]
                np.testing.assert_allclose(logits[r, : counts[r]], want, atol=1e-4, rtol=0)
            fed += counts
            if width == 3:  # undo the last two tokens and feed them again
                undo = np.minimum(2, fed)
                cache = cache.rollback(jnp.asarray(undo))
                fed -= undo
        np.testing.assert_array_equal(np.asarray(cache.lengths), LENGTHS)

    @chex.variants(with_jit=True, without_jit=True)
    def test_static(self):
        self.check("static", rollback_slots=1)

    @chex.variants(with_jit=True, without_jit=True)
    def test_dynamic(self):
        self.check("dynamic", rollback_slots=1)

    @chex.variants(with_jit=True, without_jit=True)
    def test_stacked(self):
        self.check("static", rollback_slots=1, stacked=True)


def test_config_errors_name_the_key_and_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("full_atention: static\nmax_length: many\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml") as error:
        load_config(bad, CacheConfig)
    assert "full_atention: Extra inputs are not permitted" in str(error.value)
    assert "max_length: Input should be a valid integer" in str(error.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml", CacheConfig)
    (tmp_path / "broken.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml", CacheConfig)
    good = tmp_path / "good.yaml"
    good.write_text("full_attention: dynamic\nrollback_slots: 2\n")
    assert load_config(good, CacheConfig) == CacheConfig(full_attention="dynamic", rollback_slots=2)


def test_demo_runs_and_checks_itself():
    """The README's run command: the demo exits non-zero if cached decoding disagrees."""
    result = subprocess.run(
        [sys.executable, "scripts/demo.py", "--full-attention", "dynamic"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "max |cached - uncached| logits" in result.stdout
    assert "SmolLM2-135M" in result.stdout and "Gemma-3-270M" in result.stdout
