import os

import jax
import pytest
from hypothesis import settings

# Eight host devices, as the sharding tests' meshes (1x8, 2x4, 4x2, 8x1) need; everything else runs
# on the first as before. Set before any test touches a backend.
jax.config.update("jax_num_cpu_devices", 8)

# CI replays the same examples every run; locally hypothesis explores.
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=12, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=12)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(autouse=True, scope="module")
def drop_compiled_executables():
    """After each test file, drop JAX's compiled executables: a worker process would
    otherwise keep those of every file it ran (GBs over the suite), and XLA's CPU compiler
    has aborted deep into such runs."""
    yield
    jax.clear_caches()
