"""``jaxkv bench``: the decode benchmark (``decode``) and the serving benchmark (``serving``),
jaxkv against transformers.

Application code: nothing in the library imports it. Needs the ``bench`` extra
(``pip install 'jaxkv[bench]'``: transformers and torch for the baselines, gensim for the text of the
serving workloads, matplotlib for the charts)."""
