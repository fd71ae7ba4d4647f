"""The ``jaxkv`` command line: its subcommands (``main``) and the multi-process launcher (``launch``).

Application code: nothing in the library imports it. It may import the server, the benchmarks and
the research tools, each only inside the subcommand that runs it."""
