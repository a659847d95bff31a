"""The worst of a dump: the sequences that contribute the most mismatch and the loss tokens
of largest |d|, `TOP_K` of each, as the mismatch diagnostics list them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch

from iscore.packed import TokenBatch

TOP_K = 20
"""How many worst sequences and tokens are kept."""


def worst_sequences(s: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The sequences that contribute most mismatch: largest k3 sums."""
    order = np.argsort(-s["k3"], kind="stable")[:TOP_K]
    ids = s["seq_id"].take(pa.array(order)).to_pylist() if order.size else []
    return [
        {
            "step": int(s["step"][i]),
            "seq_id": sid,
            "tokens": int(s["T"][i]),
            "abs_diff_mean": float(s["abs"][i] / max(s["T"][i], 1)),
            "abs_diff_max": float(s["max_abs"][i]),
            "k3_sum": float(s["k3"][i]),
            "log_ratio_sum": float(s["S"][i]),
        }
        for i, sid in zip(order.tolist(), ids, strict=True)
        if s["T"][i] > 0
    ]


def worst_tokens(
    batch: TokenBatch, d: torch.Tensor, absd: torch.Tensor, max_abs: np.ndarray
) -> list[dict[str, Any]]:
    """The chunk's TOP_K loss tokens of largest |d| (fewer where it has fewer), in the order
    found, searched only in the sequences that can hold them: those whose own max |d| is
    among the TOP_K largest.

    Args:
        batch: the chunk.
        d: float64 [N], its log-ratios; absd: [N], their absolute values.
        max_abs: float64 [B], each sequence's largest |d| over its loss tokens (-inf for a
            sequence without loss tokens).
    """
    found: list[dict[str, Any]] = []
    has = np.flatnonzero(max_abs != -np.inf)
    if not has.size:
        return found
    kth = np.sort(max_abs[has])[-min(TOP_K, has.size)]  # NaN sorts last, as topk ranks it
    seqs = has if np.isnan(kth) else has[~(max_abs[has] < kth)]
    cu = batch.cu_seqlens.cpu().numpy()
    tokens = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in seqs])
    owner = np.repeat(seqs, cu[seqs + 1] - cu[seqs])
    index = torch.from_numpy(tokens).to(absd.device)
    score = torch.where(batch.loss_mask[index], absd[index], -1.0)
    top = torch.topk(score, min(TOP_K, score.numel())).indices.cpu().numpy()
    for i in top.tolist():
        if float(score[i]) < 0:
            continue
        t, s = int(tokens[i]), int(owner[i])
        pos = int(batch.pos[t]) if batch.pos is not None else t - int(cu[s])
        found.append(
            {
                "step": int(batch.step[s]),
                "seq_id": batch.seq_id[s].as_py(),
                "pos": pos,
                "rollout_logprob": float(batch.rollout[t]),
                "train_logprob": float(batch.train[t]),
                "d": float(d[t]),
            }
        )
    return found
