"""The names of the frameworks iscore knows, apart from their modules: what the registry
imports them by, and what the rest of the package may mention without importing one."""

NAMES = (
    "verl",
    "skyrl",
    "nemo_rl",
    "slime",
    "areal",
    "openrlhf",
    "trl",
    "fireworks",
    "prime_rl",
    "roll",
)
"""The frameworks whose corrections iscore replays, each a module of this package."""
