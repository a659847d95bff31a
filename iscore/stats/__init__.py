"""The streaming accumulators: the mismatch diagnostics (`mismatch`), what one setting does to
a dump (`setting`), what the attribution needs (`attribution`), the noise of a step (`noise`) and
mergeable histograms (`histogram`). Each has `update` (a chunk), `merge`, `state` /
`from_state` (what a results store keeps) and `compute`.

Rule: never reads a file and never decides; imports `iscore.frameworks`, `iscore.packed` and
`iscore.utils` below it, never its sibling `iscore.dump`.
"""
