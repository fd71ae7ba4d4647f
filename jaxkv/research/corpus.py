"""The English text the experiment tasks and the serving benchmark read: the Lee corpus, 300
news articles the ``gensim`` package ships as test data (installed by the ``research`` and ``bench`` extras)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

CORPUS = ("gensim", "test/test_data/lee_background.cor")


def corpus_text() -> str:
    """The Lee corpus from the installed gensim package (found without importing gensim)."""
    package, relative = CORPUS
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"the text ships in the {package} package: install it (pip install 'jaxkv[research]' or 'jaxkv[bench]')"
        )
    path = Path(spec.submodule_search_locations[0]) / relative
    return path.read_text(encoding="utf-8")
