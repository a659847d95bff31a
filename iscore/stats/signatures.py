"""The sums three bug signatures are judged on (`iscore.advice.signatures`), gathered while
streaming and mergeable: a dump read in chunks, from a results store or by worker processes
gives the numbers of the dump read whole.

- **A shift by one position** (ms-swift#8196): the six sums (n, sum x, sum y, sum xy, sum x^2,
  sum y^2) of x = train_logprob[t] against y = rollout_logprob[t] over the loss tokens, and
  against rollout_logprob[t + 1] and rollout_logprob[t - 1] over the pairs of neighbouring loss
  tokens of one sequence, per step: their correlations (`SHIFTS`).
- **A dummy rollout log-prob of 0** (verl#5229, SkyRL#354, rllm#503): the loss tokens whose
  rollout log-prob is exactly 0, counted by their train log-prob (`ZERO_TRAIN_EDGES`).
- **A jump at one position** (sglang#25790): per position bin (`POSITION_EDGES`: every position
  below 1024, then 16 and 128 wide), the loss tokens, their sum of |d|, and the tokens whose
  |d| exceeds their own sequence's median |d|: a share bounded by 1 per token, which one
  sequence's far-off span cannot move by more than its own weight, and which does not see
  the level of a sequence, only where in it the mismatch sits. `PositionScan` compares, at
  each bin edge c, the window [c - c/2, c) with [c, c + c/2).

>>> import torch
>>> from iscore.packed import TokenBatch, ops
>>> lp = torch.tensor([-0.1, -2.0, -0.5, -1.0])
>>> stats = SignatureStats()
>>> stats.update(TokenBatch(rollout=lp, train=lp, cu_seqlens=torch.tensor([0, 4])))
>>> stats.compute().correlation[0]
1.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from iscore.packed import TokenBatch, ops
from iscore.stats.histogram import checked
from iscore.stats.noise import segment_medians

SHIFTS = ("aligned", "next", "previous")
"""What train_logprob[t] is paired with: rollout_logprob[t], [t + 1] and [t - 1]."""

_PAIR_SUMS = 6  # n, x, y, xy, x^2, y^2

ZERO_TRAIN_EDGES = (-math.inf, math.log(0.01), math.log(0.1), math.log(0.5), math.log(0.9), 0.0)
"""The train log-prob bins the loss tokens with a rollout log-prob of exactly 0 are counted in
(the trainer's probability below 1%, 1-10%, 10-50%, 50-90%, above 90%), the last bin closed."""

POSITION_EDGES = np.concatenate(
    [np.arange(0, 1024), np.arange(1024, 8192, 16), np.arange(8192, 32768 + 1, 128)]
).astype(np.int64)
"""The position bins' lower edges (the last, 32768, and beyond is one bin): exact below 1024
(where prefill chunks and KV-cache switches of a few tokens' precision sit), then 1/64 of the
position or finer."""

_POSITION_SUMS = 3  # tokens, |d|, above their sequence's median |d|

FIRST_EDGE = 16
"""The first bin edge scanned: the first tokens of a response differ by nature (the prompt's
end), and a window shorter than 8 positions says little."""

WINDOW = 0.5
"""Each side's window at a bin edge c, as a fraction of c: wide enough that a far-off span of
a few tokens in one sequence is diluted, narrow enough that a smooth trend along the position
(|d| growing as a power p^a of it) moves the windows' ratio by (1.25 / 0.75)^a at most."""


@dataclass(frozen=True, slots=True)
class PositionScan:
    """The two windows at each scanned bin edge (`SignatureStats.compute`), arrays [edges].

    Attributes:
        position: the edge c: the first position of the right window.
        width: the positions of the left and right windows, [2, edges].
        tokens: the loss tokens in each window, [2, edges].
        abs_mean: the mean |d| in each window, [2, edges] (0 without tokens).
        above: the share of each window's tokens whose |d| exceeds their sequence's median
            |d|, [2, edges] (0 without tokens).
        z: the two shares' difference (right - left) over its standard error under equal
            shares (0 where either window has no tokens).
        bins: per `POSITION_EDGES` bin, its loss tokens and their sum of |d|, [2, bins]
            (what `split` reads).
    """

    position: tuple[int, ...]
    width: tuple[tuple[int, ...], tuple[int, ...]]
    tokens: tuple[tuple[int, ...], tuple[int, ...]]
    abs_mean: tuple[tuple[float, ...], tuple[float, ...]]
    above: tuple[tuple[float, ...], tuple[float, ...]]
    z: tuple[float, ...]
    bins: tuple[tuple[float, ...], tuple[float, ...]]

    def split(self, index: int) -> int:
        """The least-squares change point of the mean |d| inside the two windows of edge
        `index`: the bin edge s that maximizes n_l n_r / (n_l + n_r) (m_l - m_r)^2 over the
        tokens of [lo, s) and [s, hi) (the windows' edge c itself, where every split is
        empty): a step's position to a bin, where the windows' own ratio peaks a few
        positions off with the noise."""
        c, (wl, wr) = self.position[index], (self.width[0][index], self.width[1][index])
        edges = POSITION_EDGES
        lo, hi = np.searchsorted(edges, c - wl), np.searchsorted(edges, c + wr)
        tokens = np.cumsum(np.asarray(self.bins[0][lo:hi]))
        total = np.cumsum(np.asarray(self.bins[1][lo:hi]))
        n_l, s_l = tokens[:-1], total[:-1]
        n_r, s_r = tokens[-1] - n_l, total[-1] - s_l
        with np.errstate(invalid="ignore", divide="ignore"):
            gain = n_l * n_r / (n_l + n_r) * (s_l / n_l - s_r / n_r) ** 2
        gain = np.nan_to_num(gain, nan=-1.0)
        return int(edges[lo + 1 + int(np.argmax(gain))]) if gain.size and gain.max() > 0 else c


@dataclass(frozen=True, slots=True)
class SignatureSummary:
    """What the three signatures are judged on.

    Attributes:
        correlation: the correlation of train_logprob[t] with rollout_logprob[t], [t + 1] and
            [t - 1] (`SHIFTS`) over every step; None where either side does not vary.
        pairs: the loss tokens, and the pairs of neighbouring loss tokens of one sequence.
        by_step: per step, (step, its three correlations, its pairs).
        zero_rollout: the loss tokens with a rollout log-prob of exactly 0 in each
            `ZERO_TRAIN_EDGES` bin of their train log-prob.
        loss_tokens: the loss tokens.
        positions: the position windows (`PositionScan`).
    """

    correlation: tuple[float | None, float | None, float | None]
    pairs: tuple[int, int]
    by_step: tuple[tuple[int, tuple[float | None, float | None, float | None], int], ...]
    zero_rollout: tuple[int, ...]
    loss_tokens: int
    positions: PositionScan


@dataclass(slots=True)
class SignatureStats:
    """Streaming accumulator of the signatures' sums (`update`, `merge`, `state`,
    `from_state`, `compute`)."""

    # Per step: float64 [len(SHIFTS), _PAIR_SUMS].
    pairs: dict[int, np.ndarray] = field(default_factory=dict)
    zeros: np.ndarray = field(default_factory=lambda: np.zeros(len(ZERO_TRAIN_EDGES) - 1))
    by_position: np.ndarray = field(
        default_factory=lambda: np.zeros((POSITION_EDGES.size, _POSITION_SUMS))
    )

    def update(self, batch: TokenBatch) -> None:
        """Add one chunk of whole sequences."""
        lengths = batch.lengths.cpu().numpy()
        x = batch.train.cpu().numpy().astype(np.float64)
        y = batch.rollout.cpu().numpy().astype(np.float64)
        # A log-prob that is not finite is left out: it would void every sum it enters.
        m = batch.loss_mask.cpu().numpy() & np.isfinite(x) & np.isfinite(y)
        self._add_pairs(x, y, m, batch, lengths)
        zero = m & (y == 0.0)
        # np.histogram's last bin is closed: a train log-prob of exactly 0 is counted.
        self.zeros += np.histogram(x[zero], bins=ZERO_TRAIN_EDGES)[0]
        self._add_positions(batch, x - y, m, lengths)

    def _add_pairs(
        self, x: np.ndarray, y: np.ndarray, m: np.ndarray, batch: TokenBatch, lengths: np.ndarray
    ) -> None:
        """Each step's sums of x = train[t] against y = rollout[t] (loss tokens), y[t + 1]
        and y[t - 1] (neighbouring loss tokens of one sequence)."""
        pair = m[:-1] & m[1:]
        offsets = np.cumsum(lengths)[:-1]
        pair[offsets[(offsets > 0) & (offsets < x.size)] - 1] = False  # across two sequences
        every = m.all()
        both = pair.all()
        sides = (
            (x, y, None) if every else (x[m], y[m], m),
            (x[:-1], y[1:], None) if both else (x[:-1][pair], y[1:][pair], pair),
            (x[1:], y[:-1], None) if both else (x[1:][pair], y[:-1][pair], pair),
        )
        seq_steps = batch.step.cpu().numpy()
        chunk_steps = np.unique(seq_steps[lengths > 0]).tolist()
        token_steps = np.repeat(seq_steps, lengths) if len(chunk_steps) > 1 else None
        for step in chunk_steps:
            sums = self.pairs.setdefault(int(step), np.zeros((len(SHIFTS), _PAIR_SUMS)))
            for row, (a, b, kept) in enumerate(sides):
                if token_steps is not None:  # a chunk is mostly one step: no selection then
                    at = token_steps if row == 0 else token_steps[:-1]
                    at = at if kept is None else at[kept]
                    a, b = a[at == step], b[at == step]
                sums[row] += [a.size, a.sum(), b.sum(), _dot(a, b), _dot(a, a), _dot(b, b)]

    def _add_positions(
        self, batch: TokenBatch, d: np.ndarray, m: np.ndarray, lengths: np.ndarray
    ) -> None:
        """The position bins' sums of the loss tokens; a token is above where its |d| exceeds
        its sequence's median |d|."""
        absd = np.abs(d)
        median = segment_medians(absd[m], ops.host_segment_sum(m, batch).astype(np.int64))
        above = absd > np.repeat(median, lengths)
        pos = batch.positions().cpu().numpy()
        index = np.maximum(np.searchsorted(POSITION_EDGES, pos, side="right") - 1, 0)
        index, absd, above = index[m], absd[m], above[m]
        size = POSITION_EDGES.size
        for column, weights in enumerate((None, absd, above)):
            self.by_position[:, column] += np.bincount(index, weights=weights, minlength=size)

    def merge(self, other: SignatureStats) -> None:
        """Add another accumulator's sums."""
        for step, sums in other.pairs.items():
            self.pairs.setdefault(step, np.zeros_like(sums))
            self.pairs[step] += sums
        self.zeros += other.zeros
        self.by_position += other.by_position

    def state(self) -> dict[str, np.ndarray]:
        """Plain arrays, for `from_state` (what a results store keeps)."""
        steps = sorted(self.pairs)
        return {
            "pair_steps": np.array(steps, dtype=np.int64),
            "pairs": np.stack([self.pairs[s] for s in steps]).reshape(
                len(steps), len(SHIFTS), _PAIR_SUMS
            )
            if steps
            else np.zeros((0, len(SHIFTS), _PAIR_SUMS)),
            "zeros": self.zeros,
            "by_position": self.by_position,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, np.ndarray]) -> SignatureStats:
        """The accumulator `state` describes.

        Raises:
            ValueError: `state` is not one `state()` wrote.
        """
        stats = cls()
        steps = checked(state, "pair_steps", "i", (-1,))
        pairs = checked(state, "pairs", "f", (steps.size, len(SHIFTS), _PAIR_SUMS))
        stats.pairs = {int(s): p.astype(np.float64) for s, p in zip(steps, pairs, strict=True)}
        stats.zeros = checked(state, "zeros", "f", stats.zeros.shape).astype(np.float64)
        shape = stats.by_position.shape
        stats.by_position = checked(state, "by_position", "f", shape).astype(np.float64)
        return stats

    def compute(self) -> SignatureSummary:
        """The correlations, the zero counts and the position windows."""
        steps = sorted(self.pairs)
        total = sum((self.pairs[s] for s in steps), np.zeros((len(SHIFTS), _PAIR_SUMS)))
        return SignatureSummary(
            correlation=_correlations(total),
            pairs=(int(total[0, 0]), int(total[1, 0])),
            by_step=tuple(
                (s, _correlations(self.pairs[s]), int(self.pairs[s][1, 0])) for s in steps
            ),
            zero_rollout=tuple(int(c) for c in self.zeros),
            loss_tokens=int(self.by_position[:, 0].sum()),
            positions=position_scan(self.by_position),
        )


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """sum(a * b) without the product's array, in one thread (BLAS's dot may split it between
    threads, and its last bits with them)."""
    return float(np.einsum("i,i->", a, b))


def _correlations(sums: np.ndarray) -> tuple[float | None, float | None, float | None]:
    """The correlation of each row of sums (n, x, y, xy, x^2, y^2); None where a side does not
    vary (or no pair).

    >>> _correlations(np.array([[2, 0, 0, 2, 2, 2], [2, 0, 0, -2, 2, 2], [0, 0, 0, 0, 0, 0]]))
    (1.0, -1.0, None)
    """
    out = []
    for n, x, y, xy, x2, y2 in sums.tolist():
        var_x, var_y = x2 - x * x / n if n else 0.0, y2 - y * y / n if n else 0.0
        # Relative to the sums: a constant side leaves rounding, not variance.
        ok = var_x > 1e-12 * max(x2, 1e-300) and var_y > 1e-12 * max(y2, 1e-300)
        out.append(min(max((xy - x * y / n) / math.sqrt(var_x * var_y), -1.0), 1.0) if ok else None)
    return tuple(out)


def position_scan(by_position: np.ndarray) -> PositionScan:
    """The windows [c - WINDOW c, c) and [c, c + WINDOW c) at every bin edge c from
    `FIRST_EDGE` whose right window ends inside the bins, each snapped to bin edges.

    Args:
        by_position: float64 [bins, 3]: per `POSITION_EDGES` bin, the loss tokens, their sum
            of |d|, and those above their sequence's median |d|.
    """
    cum = np.vstack([np.zeros((1, by_position.shape[1])), np.cumsum(by_position, axis=0)])
    edges = POSITION_EDGES
    at = np.flatnonzero(edges >= FIRST_EDGE)
    c = edges[at]
    half = np.floor(c * WINDOW).astype(np.int64)
    lo = np.searchsorted(edges, c - half, side="right") - 1
    hi = np.searchsorted(edges, c + half, side="left")
    inside = hi < edges.size  # the last bin is open: no window reaches into it
    at, c, lo, hi = at[inside], c[inside], lo[inside], hi[inside]
    left, right = cum[at] - cum[lo], cum[hi] - cum[at]
    width = (c - edges[lo], edges[hi] - c)
    n_l, n_r = left[:, 0], right[:, 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = [np.nan_to_num(side[:, 1] / side[:, 0]) for side in (left, right)]
        share = [np.nan_to_num(side[:, 2] / side[:, 0]) for side in (left, right)]
        pooled = (left[:, 2] + right[:, 2]) / (n_l + n_r)
        se = np.sqrt(pooled * (1.0 - pooled) * (1.0 / n_l + 1.0 / n_r))
        z = np.where((n_l > 0) & (n_r > 0) & (se > 0), (share[1] - share[0]) / se, 0.0)
    return PositionScan(
        position=tuple(c.tolist()),
        width=(tuple(width[0].tolist()), tuple(width[1].tolist())),
        tokens=(tuple(n_l.astype(np.int64).tolist()), tuple(n_r.astype(np.int64).tolist())),
        abs_mean=(tuple(mean[0].tolist()), tuple(mean[1].tolist())),
        above=(tuple(share[0].tolist()), tuple(share[1].tolist())),
        z=tuple(np.nan_to_num(z).tolist()),
        bins=(tuple(by_position[:, 0].tolist()), tuple(by_position[:, 1].tolist())),
    )
