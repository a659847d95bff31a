"""A dump in memory, packed: `TokenBatch` (flat tensors and sequence offsets, never padded to
the longest sequence, `batch`) and the primitives over packed sequences (`ops`), with their
compiled twins (`kernels`, over the numba functions of `numba_kernels`), each tested against
its reference.

Rule: imports only `iscore.utils` below it; knows no framework, file or statistic.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submodules=["kernels", "ops"],
    submod_attrs={
        "batch": ["TokenBatch"],
        "meta": ["META_COLUMNS"],
    },
)
