"""Reference models that take and return a ``jaxkv.Cache`` explicitly."""
