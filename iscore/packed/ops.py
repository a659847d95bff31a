"""Primitives over packed sequences: the pieces every framework's correction is made of.

Each framework module composes these in its own order, so its quirks stay visible there.
Per-token tensors are flat [N]; per-sequence tensors are [B]; `batch.seq_index` maps one
to the other. Sequence reductions accumulate in float64 whatever the input dtype.

On CPU the sequence reductions run as numpy `ufunc.reduceat` over `cu_seqlens` (one
contiguous pass, 10-20x faster than a scatter) and `broadcast` as `np.repeat`; on other
devices they stay torch scatters. Inside `shared(batch)` (what `iscore.passes.analysis` opens for
each chunk) the log-ratio, its exponentials and its sequence sums are computed once and handed to
every setting that asks for them, instead of once per setting.

>>> import torch
>>> from iscore.packed.batch import TokenBatch
>>> b = TokenBatch(rollout=torch.zeros(3), train=torch.zeros(3), cu_seqlens=torch.tensor([0, 2, 3]))
>>> segment_sum(torch.tensor([1.0, 2.0, 4.0]), b).tolist()
[3.0, 4.0]
>>> band(torch.tensor([0.5, 1.0, 2.0, 2.5]), 0.5, 2.0).tolist()
[True, True, True, False]
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from iscore.packed.batch import TokenBatch

SAFETY_BOUND = 20.0
"""The +-20 clamp on log-ratios that verl, SkyRL, slime's mis.py and Fireworks apply."""


class Shared:
    """Results computed once per batch inside `shared`: keyed by the operation, its
    parameters and the identity of its (shared) tensor inputs."""

    def __init__(self, batch: TokenBatch):
        self.batch = batch
        self.entries: dict[tuple, tuple[tuple[torch.Tensor, ...], tuple[int, ...], Any]] = {}
        self.tensors: dict[int, torch.Tensor] = {}  # id -> tensor known to be shared
        self.mask_all: bool | None = None
        self.mask_version = -1
        self.memo: dict[Any, Any] = {}

    def holds(self, *tensors: torch.Tensor | None) -> bool:
        """Whether every tensor is the batch's own or a result handed out by this cache."""
        return all(
            t is None or self.tensors.get(id(t)) is t or _batch_field(self.batch, t)
            for t in tensors
        )

    def get(self, key: tuple, inputs: tuple[torch.Tensor, ...]) -> Any:
        entry = self.entries.get(key)
        if entry is None:
            return None
        tensors, versions, result = entry
        # A caller that modified an input or a result in place invalidates the entry.
        if all(a is b for a, b in zip(tensors, inputs, strict=True)) and versions == tuple(
            t._version for t in (*inputs, result)
        ):
            return result
        return None

    def put(self, key: tuple, inputs: tuple[torch.Tensor, ...], result: torch.Tensor) -> None:
        versions = tuple(t._version for t in (*inputs, result))
        self.entries[key] = (inputs, versions, result)
        self.tensors[id(result)] = result


_SHARED: contextvars.ContextVar[Shared | None] = contextvars.ContextVar(
    "iscore_ops_shared", default=None
)


def _batch_field(batch: TokenBatch, t: torch.Tensor) -> bool:
    return t is batch.loss_mask or t is batch.rollout or t is batch.train or t is batch.policy


@contextlib.contextmanager
def shared(batch: TokenBatch, cache: Shared | None = None) -> Iterator[None]:
    """Within this block, compute the per-batch intermediates every setting shares once.

    `log_ratio(batch)`, `exp` of it, and the sequence sums / counts / means / broadcasts of
    shared tensors over the loss mask are cached for `batch` and returned as the same tensor
    to every caller; an entry whose inputs or result were modified in place is recomputed.
    Results are identical to computing each one afresh. `cache`: a `Shared(batch)` the
    caller keeps, so that this block starts with what earlier blocks computed (the app's
    `Workspace` keeps one per loaded batch: adding a setting then costs only that setting's replay).

    >>> b = TokenBatch(rollout=torch.zeros(2), train=torch.ones(2), cu_seqlens=torch.tensor([0, 2]))
    >>> with shared(b):
    ...     log_ratio(b) is log_ratio(b)
    True
    >>> kept = Shared(b)
    >>> with shared(b, kept):
    ...     d = log_ratio(b)
    >>> with shared(b, kept):
    ...     log_ratio(b) is d
    True
    """
    if cache is not None and cache.batch is not batch:
        raise ValueError("the cache belongs to another batch")
    token = _SHARED.set(Shared(batch) if cache is None else cache)
    try:
        yield
    finally:
        _SHARED.reset(token)


_REUSED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "iscore_ops_reused_buffers", default=None
)


@contextlib.contextmanager
def reused_buffers() -> Iterator[None]:
    """Within this block, `scratch` hands out the same buffers again instead of fresh ones.

    A fresh tensor of a few MB costs its page faults (~0.3 ms per MB) every time; the
    accumulators' per-token temporaries come from here, so a streamed pass allocates them
    once. Buffers are released when the block ends.
    """
    token = _REUSED.set({})
    try:
        yield
    finally:
        _REUSED.reset(token)


def scratch(name: str, n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A [n] tensor of undefined values: the reused buffer `name` (grown as needed) inside
    `reused_buffers()`, else a fresh one. Callers own it until they ask for `name` again."""
    buffers = _REUSED.get()
    if buffers is None:
        return torch.empty(n, dtype=dtype, device=device)
    buf = buffers.get(name)
    if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != torch.device(device):
        # Headroom: chunks of whole steps vary in size; growing by small steps fragments memory.
        buf = torch.empty(n + n // 4, dtype=dtype, device=device)
        buffers[name] = buf
    return buf[:n]


def _cache_for(batch: TokenBatch) -> Shared | None:
    cache = _SHARED.get()
    return cache if cache is not None and cache.batch is batch else None


def _cached(batch: TokenBatch, key: tuple, inputs: tuple, compute) -> torch.Tensor:
    """compute() once per shared batch when every input tensor is shared, else afresh."""
    cache = _cache_for(batch)
    if cache is None or not cache.holds(*inputs):
        return compute()
    inputs = tuple(t for t in inputs if t is not None)
    hit = cache.get(key, inputs)
    if hit is not None:
        return hit
    result = compute()
    cache.put(key, inputs, result)
    return result


def memo(batch: TokenBatch) -> dict[Any, Any] | None:
    """Scratch space that lives as long as `shared(batch)` (None outside it): where the
    accumulators of different settings share what they computed of the same chunk."""
    cache = _cache_for(batch)
    return None if cache is None else cache.memo


def mask_is_all(batch: TokenBatch, mask: torch.Tensor | None) -> bool:
    """Whether `mask` is None or all true (cached for the loss mask inside `shared`)."""
    if mask is None:
        return True
    cache = _cache_for(batch)
    if cache is not None and mask is batch.loss_mask:
        if cache.mask_all is None or mask._version != cache.mask_version:
            cache.mask_all = all_true(mask)
            cache.mask_version = mask._version
        return cache.mask_all
    return all_true(mask)


def all_true(mask: torch.Tensor) -> bool:
    """Whether every value of bool `mask` is true: numpy's test on the CPU (torch's reads
    250k values in 0.3 ms, numpy's in 15 us)."""
    if mask.device.type == "cpu":
        return bool(mask.numpy().all())
    return bool(mask.all())


def log_ratio(batch: TokenBatch, numerator: str = "train") -> torch.Tensor:
    """float64 [N] log-ratio of `numerator` ("train" or "policy") over the rollout log-probs.

    Differences of float32 values are exact in float64, so this is the exact d (or e).
    """
    top = getattr(batch, numerator)
    if top is None:
        raise ValueError(f"the batch has no {numerator} log-probs")

    def compute() -> torch.Tensor:
        # A copy even of float64 log-probs (`double()` would return them, and `sub_` overwrite
        # the batch's own).
        return top.to(torch.float64, copy=True).sub_(batch.rollout)

    return _cached(batch, ("log_ratio", numerator), (), compute)


def exp(x: torch.Tensor, bound: float | None = SAFETY_BOUND) -> torch.Tensor:
    """e^x, with x first clamped to [-bound, bound] unless `bound` is None."""
    cache = _SHARED.get()
    if cache is not None and cache.holds(x):
        return _cached(cache.batch, ("exp", id(x), bound), (x,), lambda: _exp(x, bound))
    return _exp(x, bound)


def exp_of(x: float) -> float:
    """e^x of one number, infinite where float64 overflows (where `math.exp` raises): a
    log-prob of -3e38 is finite and valid, the ratio built on it is not.

    >>> exp_of(0.0), exp_of(3e38), exp_of(-3e38)
    (1.0, inf, 0.0)
    """
    return math.exp(x) if x < _LOG_FLOAT64_MAX else math.inf


_LOG_FLOAT64_MAX = math.log(sys.float_info.max)


def float32(x: torch.Tensor) -> torch.Tensor:
    """x as float32 (x itself when it is already): inside `shared`, one copy of a shared
    tensor for every caller (most settings' raw ratios are the same e^d).

    >>> b = TokenBatch(rollout=torch.zeros(2), train=torch.ones(2), cu_seqlens=torch.tensor([0, 2]))
    >>> with shared(b):
    ...     rho = exp(log_ratio(b))
    ...     float32(rho) is float32(rho), float32(rho).dtype
    (True, torch.float32)
    """
    cache = _SHARED.get()
    if cache is not None and x.dtype != torch.float32 and cache.holds(x):
        return _cached(cache.batch, ("float32", id(x)), (x,), x.float)
    return x.float()


def _exp(x: torch.Tensor, bound: float | None) -> torch.Tensor:
    if bound is None:
        return torch.exp(x)
    if x.is_floating_point():
        return x.clamp(-bound, bound).exp_()  # one fresh tensor instead of two
    return torch.exp(x.clamp(-bound, bound))


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of x is finite, from one read-only pass: a sum is finite only if
    all its terms are. (A sum that overflows also gives False: use this to skip work that
    non-finite values need, never to decide a result.)"""
    return bool(torch.isfinite(x.sum()))


def truncate(
    w: torch.Tensor, lower: float | None = None, upper: float | None = None
) -> torch.Tensor:
    """Clamp weights into [lower, upper]; None leaves that side open."""
    if lower is None and upper is None:
        return w
    return w.clamp(min=lower, max=upper)


def band(x: torch.Tensor, lower: float | None = None, upper: float | None = None) -> torch.Tensor:
    """bool mask of lower <= x <= upper (inclusive; None is unbounded; NaN is outside)."""
    # Comparisons with NaN are false, so a bound already excludes NaN.
    if lower is None and upper is None:
        return ~torch.isnan(x)
    if lower is None:
        return compare("le", x, upper)
    keep = compare("ge", x, lower)
    if upper is not None:
        keep &= compare("le", x, upper)
    return keep


def _layout(batch: TokenBatch) -> tuple[np.ndarray, np.ndarray]:
    """(starts of the non-empty sequences, bool [B] non-empty or None when all are)."""
    cu = batch.cu_seqlens.numpy()
    starts = cu[:-1]
    lengths = np.diff(cu)
    if lengths.all():
        return starts, None
    nonempty = lengths > 0
    return starts[nonempty], nonempty


def _reduceat(
    ufunc: np.ufunc,
    values: np.ndarray,
    batch: TokenBatch,
    empty: float | bool,
    dtype: type | None = None,
) -> np.ndarray:
    """ufunc over each sequence's slice of `values` [N]; `empty` for empty sequences."""
    b = batch.num_sequences
    out_dtype = dtype or values.dtype
    if values.shape[0] == 0:
        return np.full(b, empty, dtype=out_dtype)
    starts, nonempty = _layout(batch)
    if nonempty is None:
        return ufunc.reduceat(values, starts, dtype=dtype)
    out = np.full(b, empty, dtype=out_dtype)
    if starts.size:
        out[nonempty] = ufunc.reduceat(values, starts, dtype=dtype)
    return out


def host_segment_sum(values: np.ndarray, batch: TokenBatch) -> np.ndarray:
    """float64 [B] sums of host `values` [N] (any numeric dtype) over each sequence."""
    return _reduceat(np.add, values, batch, 0.0, np.float64)


def host_segment_max(values: np.ndarray, batch: TokenBatch) -> np.ndarray:
    """float64 [B] maxima of host `values` [N] over each sequence (-inf for empty ones)."""
    return _reduceat(np.maximum, values, batch, -np.inf).astype(np.float64, copy=False)


_COMPARISONS = {  # torch's have the same names
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "eq": np.equal,
    "ne": np.not_equal,
}


def compare(
    op: str, x: torch.Tensor, y: torch.Tensor | float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """bool `x <op> y` ("lt", "le", "gt", "ge", "eq", "ne"), into `out` if given.

    On CPU numpy's SIMD comparisons are 3-7x faster than torch's; a Python-float `y` is
    compared in x's dtype either way.
    """
    numpy_op, torch_op = _COMPARISONS[op], getattr(torch, op)
    same = not isinstance(y, torch.Tensor) or (y.dtype == x.dtype and y.device == x.device)
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or not same:
        return torch_op(x, y) if out is None else torch_op(x, y, out=out)
    other = y.detach().numpy() if isinstance(y, torch.Tensor) else float(y)
    with np.errstate(over="ignore", invalid="ignore"):
        if out is None:
            return torch.from_numpy(numpy_op(x.detach().numpy(), other))
        numpy_op(x.detach().numpy(), other, out=out.numpy())
    return out


def nonzero(mask: torch.Tensor) -> torch.Tensor:
    """int64 indices of the true values of a flat bool tensor (numpy's, faster, on CPU)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return torch.nonzero(mask).squeeze(1)


def segment_sums_on_host(
    batch: TokenBatch, tensors: dict[str, torch.Tensor]
) -> dict[str, np.ndarray]:
    """float64 [B] host arrays: each per-token tensor [N] (any dtype) summed per sequence."""
    if _on_host(batch, *tensors.values()):
        return {name: host_segment_sum(_host(t), batch) for name, t in tensors.items()}
    stacked = torch.stack([t.double() for t in tensors.values()], dim=1)
    sums = torch.zeros(stacked.shape[1], batch.num_sequences, dtype=torch.float64)
    sums = sums.to(stacked.device).T.index_add_(0, batch.seq_index, stacked).cpu().numpy()
    return {name: sums[:, i] for i, name in enumerate(tensors)}


def groups(
    s: dict[str, np.ndarray], keys: np.ndarray, sel: np.ndarray | None = None
) -> Iterator[tuple[Any, dict[str, np.ndarray]]]:
    """(key, `s` restricted to the sequences of `sel` with that key, in their order) for each
    distinct key, ascending: one stable sort instead of a boolean selection per key and field."""
    index = np.arange(keys.size) if sel is None else np.flatnonzero(sel)
    order = index[np.argsort(keys[index], kind="stable")]
    if not order.size:
        return
    ordered = keys[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], order.size]
    columns = {k: v[order] for k, v in s.items()}
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        yield ordered[a], {k: v[a:b] for k, v in columns.items()}


def median(x: np.ndarray) -> float:
    """`np.median` of a non-empty 1-D float array, the same value (its mean of the two
    middle values, NaN where one is NaN) from one sort, without its overhead (20 us a call,
    where a length bucket of a few sequences sorts in 2).

    >>> x = np.array([3.0, -0.0, 1.0, np.inf])
    >>> [bool(median(v) == np.median(v)) for v in (x, x[:3], np.array([-0.0, -0.0]))]
    [True, True, True]
    """
    s = np.sort(x)
    if s[-1] != s[-1]:  # NaN sorts last
        return float("nan")
    k = s.size // 2
    middle = s[k - 1 + s.size % 2 : k + 1]
    if not middle.all():  # a zero: which of +0 and -0 numpy's partition picks is its own
        return float(np.median(x))
    if s.size % 2:
        return float(s[k])
    return float((s[k - 1] + (0.0 + s[k])) / 2)  # as numpy's reduction adds them


def quantiles(x: np.ndarray, qs: Sequence[float]) -> list[float]:
    """`np.quantile(x, qs)` of a non-empty 1-D float array (its default, linear
    interpolation), the same values from one sort, without its overhead (70 us a call).

    >>> x = np.array([3.0, 0.5, 1.0, 7.0, 2.0])
    >>> [bool(a == b) for a, b in zip(quantiles(x, (0.1, 0.9)), np.quantile(x, [0.1, 0.9]))]
    [True, True]
    """
    s = np.sort(x)
    n = s.size
    if s[-1] != s[-1]:  # NaN sorts last
        return [float("nan") for _ in qs]
    out = []
    for q in qs:
        position = (n - 1) * q
        if position >= n - 1:
            below = above = -1  # numpy's: the last value, and 1 + position for gamma
        else:
            below = math.floor(position)
            above = below + 1
        a, b = s[below], s[above]
        if a == 0 or b == 0:  # which of +0 and -0 numpy's partition picks is its own
            return [float(v) for v in np.quantile(x, list(qs))]
        gamma = position - below
        step = b - a
        out.append(float(b - step * (1 - gamma) if gamma >= 0.5 else a + step * gamma))
    return out


def segment_counts(mask: np.ndarray, batch: TokenBatch) -> np.ndarray:
    """float64 [B] number of true values of host bool `mask` [N] in each sequence.

    All-true, all-false and nearly uniform masks (the usual ones) are counted from the
    positions of the few exceptions instead of a full `reduceat`.
    """
    n = mask.shape[0]
    true = int(np.count_nonzero(mask))
    lengths = np.diff(batch.cu_seqlens.numpy()).astype(np.float64)
    if true == n:
        return lengths
    if true == 0:
        return np.zeros_like(lengths)
    rare = min(true, n - true)
    if rare * 64 > n:
        return _reduceat(np.add, mask.view(np.uint8), batch, 0, np.int64).astype(np.float64)
    where = np.flatnonzero(mask if true == rare else ~mask)
    seq = np.searchsorted(batch.cu_seqlens.numpy(), where, side="right") - 1
    counts = np.bincount(seq, minlength=batch.num_sequences).astype(np.float64)
    return counts if true == rare else lengths - counts


def _host(x: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor, cast to float64 where numpy lacks its dtype."""
    x = x.detach()
    if not _numpy_has(x.dtype):
        x = x.double()
    return x.numpy()


def _numpy_has(dtype: torch.dtype) -> bool:
    """Whether numpy reduces CPU tensors of `dtype` directly (others are cast to float64)."""
    return dtype in (torch.float32, torch.float64, torch.bool, torch.int32, torch.int64)


def _on_host(batch: TokenBatch, *tensors: torch.Tensor | None) -> bool:
    return batch.cu_seqlens.device.type == "cpu" and all(
        t is None or t.device.type == "cpu" for t in tensors
    )


def segment_sum(
    x: torch.Tensor, batch: TokenBatch, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 [B] sum of x over each sequence's tokens (where `mask`)."""
    return _cached(
        batch, ("segment_sum", id(x), id(mask)), (x, mask), lambda: _segment_sum(x, batch, mask)
    )


def _segment_sum(x: torch.Tensor, batch: TokenBatch, mask: torch.Tensor | None) -> torch.Tensor:
    if not _on_host(batch, x, mask):
        values = x.double() if mask is None else torch.where(mask, x.double(), 0.0)
        out = torch.zeros(batch.num_sequences, dtype=torch.float64, device=x.device)
        return out.index_add_(0, batch.seq_index, values)
    if mask is not None and not (mask is batch.loss_mask and mask_is_all(batch, mask)):
        # Zeros of x's own dtype: the sum is the same, without a float64 copy of x.
        x = x & mask if x.dtype == torch.bool else torch.where(mask, x, 0)
    values = _host(x)
    dtype = np.int64 if values.dtype == np.bool_ else np.float64
    return torch.from_numpy(_reduceat(np.add, values, batch, 0, dtype).astype(np.float64))


def segment_count(batch: TokenBatch, mask: torch.Tensor) -> torch.Tensor:
    """float64 [B] number of tokens of each sequence where `mask`."""
    if mask is batch.loss_mask and mask_is_all(batch, mask) and _on_host(batch, mask):
        return _cached(
            batch,
            ("segment_count", id(mask)),
            (mask,),
            lambda: batch.lengths.to(torch.float64),
        )
    return segment_sum(mask, batch)


def segment_mean(x: torch.Tensor, batch: TokenBatch, mask: torch.Tensor) -> torch.Tensor:
    """float64 [B] mean of x over each sequence's `mask` tokens; 0 where none are."""
    return _cached(
        batch,
        ("segment_mean", id(x), id(mask)),
        (x, mask),
        lambda: segment_sum(x, batch, mask) / segment_count(batch, mask).clamp(min=1.0),
    )


def segment_max(x: torch.Tensor, batch: TokenBatch, mask: torch.Tensor) -> torch.Tensor:
    """float64 [B] max of x over each sequence's `mask` tokens; -inf where none are."""
    if not _on_host(batch, x, mask):
        values = torch.where(mask, x.double(), -torch.inf)
        out = torch.full((batch.num_sequences,), -torch.inf, dtype=torch.float64, device=x.device)
        return out.scatter_reduce_(0, batch.seq_index, values, reduce="amax")
    if x.dtype == torch.bool or not x.is_floating_point():
        x = x.double()
    if not (mask is batch.loss_mask and mask_is_all(batch, mask)):
        x = torch.where(mask, x, -torch.inf)
    result = _reduceat(np.maximum, _host(x), batch, -np.inf)
    return torch.from_numpy(result.astype(np.float64, copy=False))


def segment_min(x: torch.Tensor, batch: TokenBatch, mask: torch.Tensor) -> torch.Tensor:
    """float64 [B] min of x over each sequence's `mask` tokens; +inf where none are."""
    return -segment_max(-x.double(), batch, mask)


def segment_all(x: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """bool [B], whether x holds for every token of a sequence (true for empty ones)."""
    if not _on_host(batch, x):
        return segment_sum(~x, batch) == 0
    return torch.from_numpy(_reduceat(np.logical_and, _host(x.bool()), batch, True, np.bool_))


def prob_diff(batch: TokenBatch) -> torch.Tensor:
    """[N] dp = e^train - e^rollout per token, in the log-probs' float32 (a probability
    trust region's statistic; a Python float bound compares with it in float32 too)."""
    return torch.exp(batch.train.float()) - torch.exp(batch.rollout)


def raw_ratio(batch: TokenBatch) -> torch.Tensor:
    """[N] rho = e^(train - rollout) per token in float32, not clamped."""
    return torch.exp(batch.train.float() - batch.rollout)


def sequence_values(batch: TokenBatch, column: str) -> torch.Tensor | None:
    """float64 [N]: each token's copy of its sequence's `column` of the batch's `extra` (null
    as NaN), or None where the batch does not carry it."""
    extra = batch.extra
    if extra is None or column not in extra.column_names:
        return None
    values = extra[column].cast("float64").to_numpy(zero_copy_only=False)
    return broadcast(torch.tensor(values, device=batch.device), batch)


def broadcast(values: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """[N] per-token copy of per-sequence `values` [B]."""
    return _cached(batch, ("broadcast", id(values)), (values,), lambda: _broadcast(values, batch))


def _broadcast(values: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    if not _on_host(batch, values) or not _numpy_has(values.dtype):
        return values[batch.seq_index]
    lengths = np.diff(batch.cu_seqlens.numpy())
    return torch.from_numpy(np.repeat(values.detach().numpy(), lengths))


def k2(d: torch.Tensor) -> torch.Tensor:
    """k2 = d^2 / 2."""
    return torch.mul(d, 0.5).mul_(d)  # (0.5 * d) * d, in one fresh tensor


def k3(d: torch.Tensor) -> torch.Tensor:
    """k3 = e^d - 1 - d (verl, NeMo-RL, slime): unbiased, >= 0, for KL(rollout || train)."""
    return torch.special.expm1(d).sub_(d)


def k3_reverse(d: torch.Tensor) -> torch.Tensor:
    """e^-d - 1 + d: AReaL's `kl_k3` and NeMo-RL's `policy_kl_error`, for KL(train || rollout)."""
    return torch.special.expm1(-d).add_(d)


BINARY_KL_EPS = 1e-6
"""KPop's clamp of both probabilities into [eps, 1 - eps] (verl #6800, prime-rl #3283): in
float32 e^l rounds to 1 for a log-prob l above -6e-8, and 1 - q would be 0."""


def binary_kl(log_p: torch.Tensor, log_q: torch.Tensor, eps: float = BINARY_KL_EPS) -> torch.Tensor:
    """KL(P || Q) of the two-event distributions P = (p, 1 - p), Q = (q, 1 - q), per token:
    p log(p / q) + (1 - p) log((1 - p) / (1 - q)), with p = e^log_p and q = e^log_q each
    clamped into [eps, 1 - eps], in the log-probs' dtype and in KPop's order of operations.

    >>> lp = torch.tensor([-0.1, -2.0, 0.0])
    >>> [round(x, 4) for x in binary_kl(lp, torch.tensor([-0.1, -0.5, -30.0])).tolist()]
    [0.0, 0.4778, 13.8155]
    """
    p = torch.exp(log_p).clamp_(eps, 1.0 - eps)
    q = torch.exp(log_q).clamp_(eps, 1.0 - eps)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 scalar mean of x over `mask` tokens (NaN where none are)."""
    return torch.where(mask, x.double(), 0.0).sum() / mask.sum()
