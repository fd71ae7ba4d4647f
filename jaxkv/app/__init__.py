"""The application layer: the ``jaxkv`` command line and its validated YAML configs.

Nothing in the library imports this package; it imports the library (models, decoding)."""
