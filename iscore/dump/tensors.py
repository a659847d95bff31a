"""Arrow chunks to `TokenBatch` tensors: zero-copy where the types fit, and batches joined.

torch is imported where tensors are made: validating a dump needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from iscore.dump.readers import Chunk, bools, plain
from iscore.errors import DumpError

if TYPE_CHECKING:
    import torch

    from iscore.batch import TokenBatch


def _tensor(values: pa.Array, dtype: pa.DataType, torch_dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy view of an Arrow array when its type already fits, else one cast."""
    import torch

    values = plain(values, dtype)
    data = values.buffers()[1]
    width = np.dtype(torch.empty((), dtype=torch_dtype).numpy().dtype).itemsize
    if len(values) == 0:
        return torch.empty(0, dtype=torch_dtype)
    return torch.frombuffer(
        data, dtype=torch_dtype, count=len(values), offset=values.offset * width
    )


def to_batch(chunk: Chunk, carried: pa.Schema | None = None) -> TokenBatch:
    """The chunk as tensors; its extra columns as the `carried` schema (missing ones null)."""
    import torch  # here, where tensors are made: validating a dump needs none

    from iscore.batch import TokenBatch

    t = chunk.per_token
    mask = t.get("loss_mask")
    lengths = torch.from_numpy(chunk.lengths)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    return TokenBatch(
        rollout=_tensor(t["rollout_logprob"], pa.float32(), torch.float32),
        train=_tensor(t["train_logprob"], pa.float32(), torch.float32),
        cu_seqlens=cu,
        loss_mask=None if mask is None else torch.from_numpy(bools(mask)),
        policy=_tensor(t["policy_logprob"], pa.float32(), torch.float32)
        if "policy_logprob" in t
        else None,
        step=torch.from_numpy(chunk.step),
        seq_id=chunk.seq_id,
        pos=_tensor(t["pos"], pa.int64(), torch.int64) if "pos" in t else None,
        extra=_conform(chunk.extra, carried, chunk.lengths.size),
    )


def _conform(extra: pa.Table | None, schema: pa.Schema | None, rows: int) -> pa.Table | None:
    """`extra` with exactly the columns of `schema` (nulls where its file has none)."""
    if schema is None or not schema.names:
        return None
    columns = [
        extra[f.name].combine_chunks()
        if extra is not None and f.name in extra.column_names
        else pa.nulls(rows, f.type)
        for f in schema
    ]
    return pa.table(columns, schema=schema)


def concat_batches(parts: list[TokenBatch]) -> TokenBatch:
    """Join batches (chunks of one file or of several) into one."""
    import torch

    from iscore.batch import TokenBatch

    def cat(name: str) -> torch.Tensor | None:
        tensors = [getattr(p, name) for p in parts]
        if all(t is None for t in tensors):
            return None
        if name == "pos":
            tensors = [p.positions() for p in parts]
        return torch.cat(tensors)

    lengths = torch.cat([p.lengths for p in parts])
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    policies = [p.policy for p in parts]
    if any(x is None for x in policies) and not all(x is None for x in policies):
        raise DumpError("some files have policy_logprob and others do not")
    ids = [p.seq_id for p in parts]
    if len({a.type for a in ids}) > 1:
        raise DumpError(
            "files disagree on the type of seq_id: " + ", ".join(str(a.type) for a in ids)
        )
    extras = [p.extra for p in parts]
    return TokenBatch(
        rollout=cat("rollout"),
        train=cat("train"),
        cu_seqlens=cu,
        loss_mask=cat("loss_mask"),
        policy=cat("policy"),
        step=cat("step"),
        seq_id=pa.concat_arrays(ids),
        pos=cat("pos"),
        extra=None if extras[0] is None else pa.concat_tables(extras).combine_chunks(),
    )
