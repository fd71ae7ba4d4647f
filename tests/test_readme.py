"""The README's API example runs as written and does what its comments say."""

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"


def test_api_example_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own README
    cache, out = scope["cache"], scope["out"]
    assert out.shape == (2, 4, 5, 8)
    # Rows were 5 and 3 tokens long in layer 0; rollback(2) then swapping the rows.
    np.testing.assert_array_equal(cache.layer(0).lengths, [1, 3])
    assert cache.layer(0).window == 4 and cache.max_rollback == 2


def test_readme_commands_match_ci():
    ci = (README.parent / ".ci" / "run").read_text()
    test_command = "bash scripts/setup.sh test && .venv/bin/python -m pytest -q"
    assert test_command in README.read_text() and test_command in ci
