"""One module per RL framework: parse its own config into a frozen spec and replay it.

Each module holds that framework's semantics in one place: `parse(config) -> Spec`, the
`Spec` dataclass (typed fields, validated in `__post_init__`) whose `replay(batch)` composes
`iscore.ops` primitives in the framework's own order, and its named `PRESETS` if it has any.
"""
