"""Shared pytest setup: hypothesis profiles.

- ``ci``: chosen when ``CI`` is set; derandomized, sized to keep the suite under 10 minutes.
- ``dev``: the default elsewhere.
- ``fuzz``: ``HYPOTHESIS_PROFILE=fuzz``; far more examples and longer stateful programs.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=60,
    stateful_step_count=40,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=60,
    stateful_step_count=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz",
    deadline=None,
    max_examples=5000,
    stateful_step_count=200,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
_default = "ci" if os.environ.get("CI") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))
