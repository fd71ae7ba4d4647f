import os

from hypothesis import settings

# CI replays the same examples every run; locally hypothesis explores.
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=12, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=12)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
