"""Arrow chunks to `TokenBatch` tensors: zero-copy where the types fit, and batches joined.

torch is imported where tensors are made: validating a dump needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from iscore.dump.columns import TOPK_COLUMNS
from iscore.dump.readers import Chunk, bools, plain
from iscore.errors import DumpError

if TYPE_CHECKING:
    import torch

    from iscore.packed import TokenBatch


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

    from iscore.packed import TokenBatch

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
        turn=_tensor(t["turn"], pa.int64(), torch.int64) if "turn" in t else None,
        routing_agrees=torch.from_numpy(routing_agrees(t["rollout_experts"], t["train_experts"]))
        if "rollout_experts" in t
        else None,
        floor=_tensor(t["floor_logprob"], pa.float32(), torch.float32)
        if "floor_logprob" in t
        else None,
        **_topk(t),
        **_token_ids(t),
    )


def _topk(per_token: dict[str, pa.Array]) -> dict[str, torch.Tensor]:
    """The top-k tensors (and the sampled ids beside them) of a chunk that has them."""
    import torch

    if "rollout_topk_ids" not in per_token:
        return {}
    out = {}
    # int32 ids (the writer's) stay int32: a cast of k ids a token costs more than their read.
    ids = pc.list_flatten(per_token["rollout_topk_ids"]).type
    kinds = (
        (pa.int32(), torch.int32) if ids == pa.int32() else (pa.int64(), torch.int64),
        (pa.float32(), torch.float32),
        (pa.float32(), torch.float32),
    )
    for name, column, (dtype, torch_dtype) in zip(
        ("topk_ids", "rollout_topk", "train_topk"), TOPK_COLUMNS, kinds, strict=True
    ):
        lists = per_token[column]
        flat = _tensor(pc.list_flatten(lists), dtype, torch_dtype)  # checked: k each
        out[name] = flat.reshape(len(lists), -1)
    return out


def _token_ids(per_token: dict[str, pa.Array]) -> dict[str, torch.Tensor]:
    """The sampled ids (`token_id`, read beside the top-k columns or the trainer's ids) and the
    trainer's (`train_token_id`), of a chunk that has them."""
    import torch

    return {
        name: _tensor(per_token[name], pa.int64(), torch.int64)
        for name in ("token_id", "train_token_id")
        if name in per_token
    }


def routing_agrees(rollout: pa.Array, train: pa.Array) -> np.ndarray:
    """bool [N]: whether each token's two lists of expert ids hold the same ids, order aside
    (equal as multisets: the order a router reports its top-k in is not part of the choice).

    The lists are compared flat (values and offsets), never padded: sorted within each token,
    by a sort along rows where every token lists k ids, else by one sort of the ids keyed by
    their token.

    >>> routing_agrees(pa.array([[3, 1], [2, 5]]), pa.array([[1, 3], [2, 6]])).tolist()
    [True, False]

    Raises:
        ValueError: a token's two lists differ in length (the readers report it first).
    """
    lengths = pc.list_value_length(rollout).fill_null(0).to_numpy(zero_copy_only=False)
    other = pc.list_value_length(train).fill_null(0).to_numpy(zero_copy_only=False)
    if not np.array_equal(lengths, other):
        raise ValueError("Expected both sides to list as many expert ids for each token")
    a, b = (pc.list_flatten(ids).cast(pa.int64()).to_numpy() for ids in (rollout, train))
    n = lengths.size
    if n and (lengths == lengths[0]).all():
        k = int(lengths[0])
        a, b = np.sort(a.reshape(n, k), axis=1), np.sort(b.reshape(n, k), axis=1)
        return (a == b).all(axis=1)
    token = np.repeat(np.arange(n), lengths)
    a, b = a[np.lexsort((a, token))], b[np.lexsort((b, token))]
    return np.bincount(token[a != b], minlength=n) == 0


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

    from iscore.packed import TokenBatch

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
    for name in ("policy", "floor"):
        having = [getattr(p, name) is not None for p in parts]
        if any(having) and not all(having):
            raise DumpError(f"some files have {name}_logprob and others do not")
    for name, column in (
        ("topk_ids", "rollout_topk_ids"),
        ("token_id", "token_id"),
        ("train_token_id", "train_token_id"),
    ):
        having = [getattr(p, name) is not None for p in parts]
        if any(having) and not all(having):
            raise DumpError(f"some files have {column} and others do not")
    ks = {p.topk_ids.shape[-1] for p in parts if p.topk_ids is not None}
    if len(ks) > 1:
        raise DumpError(f"files list different numbers of top-k ids: {sorted(ks)}")
    ids = [p.seq_id for p in parts]
    if len({a.type for a in ids}) > 1:
        raise DumpError(
            "files disagree on the type of seq_id: " + ", ".join(str(a.type) for a in ids)
        )
    for name, column in (("turn", "turn"), ("routing_agrees", "rollout_experts")):
        having = [getattr(p, name) is not None for p in parts]
        if any(having) and not all(having):
            raise DumpError(f"some files have {column} and others do not")
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
        turn=cat("turn"),
        routing_agrees=cat("routing_agrees"),
        floor=cat("floor"),
        token_id=cat("token_id"),
        train_token_id=cat("train_token_id"),
        topk_ids=cat("topk_ids"),
        rollout_topk=cat("rollout_topk"),
        train_topk=cat("train_topk"),
    )
