"""Example budgets of the property tests: a bounded default run and a ``long`` profile for more.

Each property states its budget for the default run (sized so a property file takes seconds on a 2-core
CPU machine) through :func:`examples`, which scales it by the loaded hypothesis profile. The ``long``
profile runs :data:`LONG_FACTOR` times as many examples of every property; use it after changing a kernel
or the model:

    RLFW_HYPOTHESIS_PROFILE=long pytest tests/kernels/test_linear_properties.py \
        tests/kernels/test_op_properties.py tests/model/test_model_properties.py -q

(``pytest --hypothesis-profile=long ...`` selects the same profile.) A failing example is printed with
its reproduction blob (``print_blob``); hypothesis also keeps it in ``.hypothesis/`` and replays it first
on the next run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_ENV = "RLFW_HYPOTHESIS_PROFILE"
BASE_EXAMPLES = 100
"""``max_examples`` of hypothesis's own default profile: a budget ``n`` means ``n`` examples under it."""
LONG_FACTOR = 20
PROFILES = ("default", "long")

settings.register_profile(
    "long",
    max_examples=BASE_EXAMPLES * LONG_FACTOR,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def load_profile() -> None:
    """Load the profile named by ``RLFW_HYPOTHESIS_PROFILE`` (nothing to do when it is unset)."""
    name = os.environ.get(PROFILE_ENV)
    if name is None:
        return
    if name not in PROFILES:
        raise ValueError(f"{PROFILE_ENV}={name!r} is not a profile; allowed values: {', '.join(PROFILES)}")
    settings.load_profile(name)


def examples(n: int) -> int:
    """``n`` examples in the default run; ``max_examples / 100`` times as many under another profile.

    Read when a test module is imported, after ``tests/conftest.py`` (or ``--hypothesis-profile``) has
    loaded the profile.
    """
    return max(1, n * settings().max_examples // BASE_EXAMPLES)
