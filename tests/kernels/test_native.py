"""The native kernel library's loader (``jaxkv.kernels.native``): built by the setup here, run on
XLA's intra-op thread pool; without it (no compiler at install, or switched off) one log line and
the pure-JAX paths, which give the same results."""

import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels import native, quantized
from jaxkv.kernels.backends import XLA, resolve_backend


@pytest.fixture
def fresh_loader():
    """The loader's memo cleared before and after (each case decides afresh)."""
    for cached in (native.library, native.target, quantized._target):
        cached.cache_clear()
    yield
    for cached in (native.library, native.target, quantized._target):
        cached.cache_clear()


def test_the_setup_built_the_library_and_it_runs_on_xla_threads(fresh_loader):
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the setup installs without the kernels")
    assert native.available(), "bash scripts/setup.sh builds jaxkv.kernels._cpu where g++ exists"
    assert native.pool_threads() >= 1


def test_without_the_library_one_log_line_and_the_pure_jax_paths(fresh_loader, monkeypatch, caplog):
    monkeypatch.setattr(native.importlib.util, "find_spec", lambda name: None)  # as installed without g++
    with caplog.at_level(logging.WARNING, logger="jaxkv.kernels.native"):
        assert native.library() is None and native.library() is None
        assert native.target("JaxkvCpuThreads") is None and native.pool_threads() is None
    assert len(caplog.records) == 1 and "not built" in caplog.records[0].getMessage()
    assert resolve_backend("auto", "cpu") == XLA
    with pytest.raises(ValueError, match="attention_backend cpu: the native CPU kernels are off"):
        resolve_backend("cpu", "cpu")
    w = quantized.quantize(np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32), "q8_0")
    x = jnp.ones((2, 64), jnp.float32)
    out = jax.jit(lambda x: x @ w.T)(x)  # "auto" takes the pure-JAX path
    np.testing.assert_allclose(out, np.asarray(x) @ np.asarray(w.dequantize()).T, rtol=1e-5, atol=1e-5)


def test_the_switch_turns_the_kernels_off(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv(native.SWITCH, "0")
    with caplog.at_level(logging.INFO, logger="jaxkv.kernels.native"):
        assert not native.available()
    assert "off" in caplog.records[0].getMessage()
