"""A dump in memory, packed: `TokenBatch` (flat tensors and sequence offsets, never padded) and
the primitives over packed sequences (`ops`), with their compiled twins (`kernels`, over the
numba functions of `numba_kernels`), each tested against its reference.

Rule: imports only `iscore.utils` below it; knows no framework, file or statistic.
"""
