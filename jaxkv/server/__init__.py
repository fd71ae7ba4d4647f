"""``jaxkv serve``: the OpenAI-compatible HTTP server over the serving engine (``api``).

Application code: nothing in the library imports it. Needs the ``serve`` extra
(``pip install 'jaxkv[serve]'``: fastapi, uvicorn, prometheus-client)."""
