"""The fuzzing profiles (see `tests/fuzz/__init__.py`): "ci", quick and fixed, and "night",
selected with ISCORE_FUZZ=night."""

from hypothesis import HealthCheck, settings

_QUIET = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.large_base_example,
]

settings.register_profile(
    "iscore-fuzz-ci",
    derandomize=True,  # the same examples every run: CI cannot flake
    database=None,
    deadline=None,
    suppress_health_check=_QUIET,
    print_blob=True,
)
settings.register_profile(
    "iscore-fuzz-night",
    max_examples=20_000,
    deadline=None,
    suppress_health_check=_QUIET,
    print_blob=True,
)
