"""`TokenBatch`: a dump in memory as packed tensors, never padded to the longest sequence.

Every per-token quantity is one flat tensor over all tokens of all sequences, back to back;
`cu_seqlens[i]:cu_seqlens[i + 1]` is sequence i's slice (the layout of FlashAttention's
varlen kernels). A 9k-token sequence next to a hundred 200-token ones costs 29k slots, not
909k.

>>> import torch
>>> b = TokenBatch(
...     rollout=torch.tensor([-0.1, -2.0, -0.5]),
...     train=torch.tensor([-0.1, -1.9, -0.6]),
...     cu_seqlens=torch.tensor([0, 2, 3]),
... )
>>> b.num_sequences, b.num_tokens, b.lengths.tolist()
(2, 3, [2, 1])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from iscore.packed.meta import META_COLUMNS

_PER_TOKEN = (
    "rollout", "train", "loss_mask", "policy", "pos", "turn", "routing_agrees", "floor",
    "token_id", "train_token_id", "topk_ids", "rollout_topk", "train_topk",
)  # fmt: skip
"""The per-token tensors of a batch, [N] each ([N, k] for the top-k ones)."""


_TOPK = ("topk_ids", "rollout_topk", "train_topk")


@dataclass(frozen=True, slots=True, eq=False)
class TokenBatch:
    """Packed per-token log-probs of a set of sequences.

    Args:
        rollout: float32 [N], log-prob of each sampled token under the rollout engine.
        train: float32 [N], the trainer's recomputed log-prob of the same token.
        cu_seqlens: int64 [B + 1], sequence offsets into the token tensors; starts at 0.
        loss_mask: bool [N], whether the token counts in the loss; all true by default.
        policy: float32 [N] or None, the current policy's log-prob (current-policy IS).
        step: int64 [B], training step of each sequence; zeros by default.
        seq_id: Arrow array [B] of the sequences' ids (integers or strings); 0..B-1 by default.
        pos: int64 [N] or None, each token's position as given in the dump; None means
            0..T-1 within each sequence.
        extra: Arrow table [B rows] or None, the dump's other per-sequence columns (reward,
            group_id, the mean advantage, ...) where reading was asked to carry them, and
            the metadata columns (`META_COLUMNS`) wherever the dump has them.
        turn: int64 [N] or None, each token's turn in a multi-turn conversation (`turn`).
        routing_agrees: bool [N] or None, whether the rollout's and the trainer's routers
            picked the same experts for the token (`rollout_experts`, `train_experts`: the
            ids themselves are compared as they are read, and not kept).
        floor: float32 [N] or None, the trainer's log-prob of the token from a second
            recompute (`floor_logprob`): train - floor is the trainer's own noise.
        token_id: int64 [N] or None, the sampled token's id, read beside the top-k columns
            and beside `train_token_id`.
        train_token_id: int64 [N] or None, the id of the token the trainer scored at each
            position (`train_token_id`): a re-tokenized sequence scores other tokens.
        topk_ids: int32 or int64 [N, k] or None, the engine's k most likely ids at each token
            (`rollout_topk_ids`); rollout_topk, train_topk: float32 [N, k], the engine's and
            the trainer's log-probs of them (docs/distribution.md).
    """

    rollout: torch.Tensor
    train: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor | None = None
    policy: torch.Tensor | None = None
    step: torch.Tensor | None = None
    seq_id: pa.Array | None = None
    pos: torch.Tensor | None = None
    extra: pa.Table | None = None
    turn: torch.Tensor | None = None
    routing_agrees: torch.Tensor | None = None
    floor: torch.Tensor | None = None
    token_id: torch.Tensor | None = None
    train_token_id: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    rollout_topk: torch.Tensor | None = None
    train_topk: torch.Tensor | None = None
    _seq_index: list[torch.Tensor] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        n = self.rollout.shape[0]
        b = self.cu_seqlens.shape[0] - 1
        device = self.rollout.device
        # Defaults are filled in here so every consumer can rely on the full set of fields.
        if self.loss_mask is None:
            object.__setattr__(self, "loss_mask", torch.ones(n, dtype=torch.bool, device=device))
        if self.step is None:
            object.__setattr__(self, "step", torch.zeros(b, dtype=torch.int64, device=device))
        if self.seq_id is None:
            object.__setattr__(self, "seq_id", pa.array(np.arange(b, dtype=np.int64)))
        k = None if self.topk_ids is None else self.topk_ids.shape[-1]
        for name in _PER_TOKEN:
            tensor = getattr(self, name)
            shape = (n, k) if name in _TOPK else (n,)
            if tensor is not None and tuple(tensor.shape) != shape:
                raise ValueError(
                    f"Expected `{name}` of shape {shape}, but got {tuple(tensor.shape)}"
                )
        if (self.topk_ids is None) != (self.rollout_topk is None) or (self.topk_ids is None) != (
            self.train_topk is None
        ):
            raise ValueError("Expected `topk_ids`, `rollout_topk` and `train_topk` together")
        if self.extra is not None and self.extra.num_rows != b:
            raise ValueError(f"Expected `extra` of {b} rows, but got {self.extra.num_rows}")
        if self.step.shape != (b,) or len(self.seq_id) != b:
            raise ValueError(
                f"Expected `step` and `seq_id` of length {b}, but got "
                f"{tuple(self.step.shape)} and {len(self.seq_id)}"
            )
        if b < 0 or int(self.cu_seqlens[0]) != 0 or int(self.cu_seqlens[-1]) != n:
            raise ValueError(f"Expected `cu_seqlens` to run from 0 to {n}")

    def __repr__(self) -> str:
        """One line: the counts, the steps, where it lives and which optional columns it has
        (the tensors themselves fill a screen; `batch.rollout` shows them).

        >>> zeros = torch.zeros(3)
        >>> TokenBatch(rollout=zeros, train=zeros, cu_seqlens=torch.tensor([0, 2, 3]))
        TokenBatch(2 sequences, 3 tokens (3 in the loss), step 0, cpu)
        """
        steps = (int(self.step.min()), int(self.step.max())) if self.num_sequences else None
        parts = [
            f"{self.num_sequences:,} sequence{'s' * (self.num_sequences != 1)}",
            f"{self.num_tokens:,} token{'s' * (self.num_tokens != 1)} "
            f"({int(self.loss_mask.sum()):,} in the loss)",
        ]
        if steps is not None:
            parts.append(
                f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}..{steps[1]}"
            )
        parts.append(str(self.device))
        if self.policy is not None:
            parts.append("with policy log-probs")
        if self.pos is not None:
            parts.append("with positions")
        if self.turn is not None:
            parts.append("with turns")
        if self.routing_agrees is not None:
            parts.append("with routing agreement")
        if self.floor is not None:
            parts.append("with a noise floor")
        if self.topk_ids is not None:
            parts.append(f"with top-{self.topk_ids.shape[-1]} log-probs")
        if self.extra is not None:
            parts.append(f"extra columns {', '.join(self.extra.column_names)}")
        return f"TokenBatch({', '.join(parts)})"

    @property
    def num_tokens(self) -> int:
        """N, the number of tokens of all sequences together."""
        return self.rollout.shape[0]

    @property
    def num_sequences(self) -> int:
        """B, the number of sequences."""
        return self.cu_seqlens.shape[0] - 1

    @property
    def lengths(self) -> torch.Tensor:
        """int64 [B], the number of tokens of each sequence."""
        return self.cu_seqlens.diff()

    @property
    def device(self) -> torch.device:
        """Where the tensors live."""
        return self.rollout.device

    @property
    def seq_index(self) -> torch.Tensor:
        """int64 [N], the sequence each token belongs to (computed once, then cached)."""
        if not self._seq_index:
            index = torch.repeat_interleave(
                torch.arange(self.num_sequences, device=self.device), self.lengths
            )
            self._seq_index.append(index)
        return self._seq_index[0]

    def positions(self) -> torch.Tensor:
        """int64 [N], `pos` as given in the dump, else 0..T-1 within each sequence."""
        if self.pos is not None:
            return self.pos
        starts = torch.repeat_interleave(self.cu_seqlens[:-1], self.lengths)
        return torch.arange(self.num_tokens, device=self.device) - starts

    def to(self, device: str | torch.device) -> TokenBatch:
        """Copy the tensors to `device` ("cuda", "cpu"); ids stay in host memory."""
        moved = {
            name: None if getattr(self, name) is None else getattr(self, name).to(device)
            for name in (*_PER_TOKEN, "cu_seqlens", "step")
        }
        return replace(self, **moved, _seq_index=[])

    def select(self, keep: torch.Tensor) -> TokenBatch:
        """The sequences where bool `keep` [B] is true, in order.

        >>> b = TokenBatch(rollout=torch.zeros(3), train=torch.zeros(3),
        ...                cu_seqlens=torch.tensor([0, 2, 3]))
        >>> b.select(torch.tensor([False, True])).seq_id.to_pylist()
        [1]
        """
        return self.take(torch.nonzero(keep.to(self.device)).flatten())

    def take(
        self,
        order: torch.Tensor,
        copy_runs: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], bool] | None = None,
    ) -> TokenBatch:
        """The sequences at the indices `order` [K] (int64), in that order: one gather of
        every per-token tensor (a step's sequences of a chunk whose steps interleave, gathered
        once where a `select` per step would read every tensor each time). `copy_runs(x,
        starts, lengths, out)` (`kernels.gather_runs`), where it answers True, copies a host
        tensor's sequences run by run instead.

        >>> b = TokenBatch(rollout=torch.arange(3.0), train=torch.zeros(3),
        ...                cu_seqlens=torch.tensor([0, 2, 3]))
        >>> t = b.take(torch.tensor([1, 0]))
        >>> t.rollout.tolist(), t.cu_seqlens.tolist(), t.seq_id.to_pylist()
        ([2.0, 0.0, 1.0], [0, 1, 3], [1, 0])
        """
        order = order.to(self.device)
        lengths = self.lengths[order]
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(lengths, 0, out=cu[1:])
        starts = self.cu_seqlens[:-1][order]
        rows = pa.array(order.cpu().numpy())
        index: list[torch.Tensor] = []

        def tokens() -> torch.Tensor:
            """Token j of the result is token j - cu[k] of sequence order[k], k its sequence."""
            if not index:
                shift = torch.repeat_interleave(starts - cu[:-1], lengths)
                index.append(torch.arange(int(cu[-1]), device=self.device) + shift)
            return index[0]

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if copy_runs is not None and t.device.type == "cpu" and t.is_contiguous():
                out = torch.empty((int(cu[-1]), *t.shape[1:]), dtype=t.dtype)
                width = math.prod(t.shape[1:])  # a top-k tensor's k values a token
                runs = (starts.numpy() * width, lengths.numpy() * width)
                if copy_runs(t.reshape(-1).numpy(), *runs, out.reshape(-1).numpy()):
                    return out
            return t[tokens()]

        return TokenBatch(
            rollout=pick(self.rollout),
            train=pick(self.train),
            cu_seqlens=cu,
            loss_mask=pick(self.loss_mask),
            policy=pick(self.policy),
            step=self.step[order],
            seq_id=self.seq_id.take(rows),
            pos=pick(self.pos),
            extra=None if self.extra is None else self.extra.take(rows),
            turn=pick(self.turn),
            routing_agrees=pick(self.routing_agrees),
            floor=pick(self.floor),
            token_id=pick(self.token_id),
            train_token_id=pick(self.train_token_id),
            topk_ids=pick(self.topk_ids),
            rollout_topk=pick(self.rollout_topk),
            train_topk=pick(self.train_topk),
        )

    def slice(self, start: int, stop: int) -> TokenBatch:
        """Sequences `start` to `stop - 1`, viewing this batch's tensors (nothing is copied
        but the offsets).

        >>> b = TokenBatch(rollout=torch.zeros(3), train=torch.zeros(3),
        ...                cu_seqlens=torch.tensor([0, 2, 3]))
        >>> b.slice(1, 2).num_tokens, b.slice(1, 2).seq_id.to_pylist()
        (1, [1])
        """
        a, b = int(self.cu_seqlens[start]), int(self.cu_seqlens[stop])

        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[a:b]

        return TokenBatch(
            rollout=self.rollout[a:b],
            train=self.train[a:b],
            cu_seqlens=self.cu_seqlens[start : stop + 1] - a,
            loss_mask=part(self.loss_mask),
            policy=part(self.policy),
            step=self.step[start:stop],
            seq_id=self.seq_id.slice(start, stop - start),
            pos=part(self.pos),
            extra=None if self.extra is None else self.extra.slice(start, stop - start),
            turn=part(self.turn),
            routing_agrees=part(self.routing_agrees),
            floor=part(self.floor),
            token_id=part(self.token_id),
            train_token_id=part(self.train_token_id),
            topk_ids=part(self.topk_ids),
            rollout_topk=part(self.rollout_topk),
            train_topk=part(self.train_topk),
        )

    def to_arrow(self) -> pa.Table:
        """The batch as a canonical token-layout table, one row per token, in batch order
        (the expert ids are not kept, so neither is routing agreement; of the `extra`
        columns, the metadata ones are, repeated on their sequence's rows)."""
        lengths = self.lengths.cpu().numpy()
        seq_rows = np.repeat(np.arange(self.num_sequences), lengths)
        columns = {
            "step": pa.array(np.repeat(self.step.cpu().numpy(), lengths)),
            "seq_id": self.seq_id.take(pa.array(seq_rows)),
            "pos": pa.array(self.positions().cpu().numpy()),
            "rollout_logprob": pa.array(self.rollout.cpu().numpy()),
            "train_logprob": pa.array(self.train.cpu().numpy()),
            "loss_mask": pa.array(self.loss_mask.cpu().numpy()),
        }
        if self.policy is not None:
            columns["policy_logprob"] = pa.array(self.policy.cpu().numpy())
        if self.floor is not None:
            columns["floor_logprob"] = pa.array(self.floor.cpu().numpy())
        for name in ("token_id", "train_token_id"):
            if getattr(self, name) is not None:
                columns[name] = pa.array(getattr(self, name).cpu().numpy())
        for name, column in zip(_TOPK, ("rollout_topk_ids", "rollout_topk_logprobs",
                                        "train_topk_logprobs"), strict=True):  # fmt: skip
            values = getattr(self, name)
            if values is not None:
                k = values.shape[-1]
                offsets = pa.array(np.arange(0, values.numel() + 1, max(k, 1), dtype=np.int32))
                columns[column] = pa.ListArray.from_arrays(offsets, values.cpu().numpy().ravel())
        if self.turn is not None:
            columns["turn"] = pa.array(self.turn.cpu().numpy())
        for name in META_COLUMNS:
            if self.extra is not None and name in self.extra.column_names:
                columns[name] = self.extra[name].combine_chunks().take(pa.array(seq_rows))
        return pa.table(columns)

    def to_parquet(self, path: str | Path) -> None:
        """Write the batch as a canonical token-layout Parquet file."""
        pq.write_table(self.to_arrow(), path, compression="zstd")

    def equal(self, other: TokenBatch) -> bool:
        """Whether both batches hold the same values in the same order."""

        def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
            if a is None or b is None:
                return a is b
            return a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())

        return (
            all(
                same(getattr(self, name), getattr(other, name))
                for name in ("cu_seqlens", "step", *_PER_TOKEN)
                if name != "pos"
            )
            and torch.equal(self.positions().cpu(), other.positions().cpu())
            and self.seq_id.equals(other.seq_id)
        )
