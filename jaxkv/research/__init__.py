"""Research tools: the tasks of ``jaxkv experiment`` (``tasks``, over the text of ``corpus``), the
experiment grid (``experiment``), the one prefill every cache of a context is refilled from
(``observer``) and the multi-query associative recall model and trainer (``mqar``).

Application code: nothing in the library imports it. Needs the ``research`` extra
(``pip install 'jaxkv[research]'``: optax, matplotlib, gensim)."""
