"""The names of the per-sequence metadata columns, without torch (the dump's readers and
validation import them)."""

META_COLUMNS = ("weight_version", "replica", "rank", "host", "device")
"""The per-sequence metadata columns a batch's `extra` holds whenever its dump has them: the
policy version the engine sampled with, the engine instance, the trainer rank, the host and
the device (a GPU model) that scored the sequence (docs/why.md#the-metadata-breakdown)."""
