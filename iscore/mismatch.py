"""Mismatch diagnostics of a dump: how far apart the rollout and trainer log-probs are.

`MismatchStats` is a streaming accumulator (`update` per chunk, `merge`, `compute`). Token-level
quantities are summed per sequence as chunks arrive, so every overall, per-step and
per-length statistic is computed at the end from per-sequence sums: a dump read in chunks gives
exactly the numbers of the dump read whole.

All statistics are over loss tokens (loss_mask true), with d = train_logprob - rollout_logprob,
S = sum of d over a sequence's loss tokens, T their count and G = S / T. `METRIC_NAMES` says
what each framework calls each number, so the values can be matched with W&B charts.

>>> import iscore                                           # doctest: +SKIP
>>> stats = MismatchStats(); stats.update(iscore.load("data/fp8.parquet"))  # doctest: +SKIP
>>> stats.compute()["k3"]                                   # doctest: +SKIP
0.0498
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from iscore import ops
from iscore.batch import TokenBatch
from iscore.histogram import Histogram2D, LogHistogram, bucket_label, log2_bucket

PROB_EDGES = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0)
"""Buckets of the rollout probability of the sampled token, exp(rollout_logprob)."""

TOP_K = 20
"""How many worst sequences and tokens are kept."""

Z90 = 1.2815515655446004
"""The standard normal's 90% quantile: p10/p90 of a normal are mean -+ Z90 * sd."""

METRIC_NAMES: dict[str, list[str]] = {
    "k1": [
        "verl rollout_corr/kl",
        "slime mis_kl (sequence-averaged)",
        "OpenRLHF vllm_kl",
        "AReaL -behave_approx_kl",
        "NeMo-RL gen_kl_error (kl_type k1)",
    ],
    "k2": ["NeMo-RL gen_kl_error (kl_type k2)"],
    "k3": [
        "verl rollout_corr/k3_kl",
        "NeMo-RL gen_kl_error (default k3)",
        "slime mis_k3_kl (sequence-averaged)",
        "blogs: vllm-kl",
    ],
    "k3_reverse": ["NeMo-RL policy_kl_error", "AReaL rejection_sampling kl_k3 statistic"],
    "chi2_token": ["verl rollout_corr/chi2_token", "slime mis_chi2_token (sequence-averaged)"],
    "chi2_seq": ["verl rollout_corr/chi2_seq", "slime mis_chi2_seq"],
    "abs_diff_mean": [
        "slime train/train_rollout_logprob_abs_diff (sequence-averaged)",
        "SkyRL policy/rollout_train_logprobs_abs_diff_mean",
        "TRL sampling/sampling_logp_difference/mean",
    ],
    "abs_diff_max": [
        "SkyRL policy/rollout_train_logprobs_abs_diff_max",
        "TRL sampling/sampling_logp_difference/max",
    ],
    "token_mult_prob_error": ["NeMo-RL token_mult_prob_error"],
    "js": ["NeMo-RL js_divergence_error"],
    "log_ppl_diff": ["verl rollout_corr/log_ppl_diff", "slime mis_log_ppl_diff"],
    "log_ppl_abs_diff": ["verl rollout_corr/log_ppl_abs_diff", "slime mis_log_ppl_abs_diff"],
    "ppl_ratio": ["verl rollout_corr/ppl_ratio", "slime mis_ppl_ratio"],
    "training_ppl": ["verl rollout_corr/training_ppl", "slime mis_training_ppl"],
    "rollout_ppl": ["verl rollout_corr/rollout_ppl", "slime mis_rollout_ppl"],
    "ratio_mean": ["SkyRL is_ratio_mean", "slime tis (before clipping)"],
}
"""For each statistic, the names the frameworks log it under (corrections.md section 4).

Where a framework averages per sequence first (slime's mis_*), its value differs from the
token average iscore reports; the name says so.
"""

DEFINITIONS: dict[str, str] = {
    "k1": "<-d>_tok: k1 estimate of KL(rollout || train); can be negative",
    "k2": "<d^2 / 2>_tok",
    "k3": "<e^d - 1 - d>_tok: unbiased, non-negative estimate of KL(rollout || train)",
    "k3_reverse": "<e^-d - 1 + d>_tok: k3 of KL(train || rollout); explodes where the trainer "
    "finds a token much less likely than the sampler",
    "chi2_token": "<e^(2 clamp(d, +-20))>_tok - 1",
    "chi2_seq": "<e^(2 clamp(S, +-20))>_seq - 1",
    "abs_diff_mean": "<|d|>_tok",
    "abs_diff_max": "max |d| over loss tokens",
    "token_mult_prob_error": "<e^|d|>_tok (NeMo-RL: ~1.0 healthy, > 1.05 suspicious)",
    "js": "<(e^a - 1 - a)/2 + (e^b - 1 - b)/2>_tok with a = train - log m, b = rollout - log m, "
    "m = (e^train + e^rollout)/2",
    "log_ppl_diff": "<-G>_seq = log-PPL(train) - log-PPL(rollout)",
    "log_ppl_abs_diff": "<|G|>_seq",
    "ppl_ratio": "<e^-G>_seq",
    "training_ppl": "<exp(-mean train_logprob)>_seq",
    "rollout_ppl": "<exp(-mean rollout_logprob)>_seq",
    "ratio_mean": "<e^d>_tok: exactly 1 in expectation when tokens are sampled from the rollout "
    "engine and both log-probs are of the same distribution",
}

# Per-sequence sums collected from each chunk; every statistic is computed from these.
_SEQ_FIELDS = (
    "T",
    "length",
    "S",
    "abs",
    "d2",
    "k3",
    "k3r",
    "chi",
    "mult",
    "js",
    "rho",
    "rho2",
    "train",
    "rollout",
    "max_abs",
)
# Token-level sums kept per probability / position bucket.
_BUCKET_FIELDS = ("tokens", "abs", "k3", "d")


@dataclass(slots=True)
class MismatchStats:
    """Streaming accumulator of the mismatch diagnostics of a dump.

    >>> stats = MismatchStats()
    >>> for chunk in dump.batches(): stats.update(chunk)  # doctest: +SKIP
    >>> result = stats.compute()                           # doctest: +SKIP
    """

    seq: dict[str, list[np.ndarray]] = field(default_factory=lambda: {k: [] for k in _SEQ_FIELDS})
    steps: list[np.ndarray] = field(default_factory=list)
    seq_ids: list[pa.Array] = field(default_factory=list)
    by_prob: np.ndarray = field(
        default_factory=lambda: np.zeros((len(PROB_EDGES) - 1, len(_BUCKET_FIELDS)))
    )
    by_pos: np.ndarray = field(default_factory=lambda: np.zeros((32, len(_BUCKET_FIELDS))))
    abs_hist: LogHistogram = field(default_factory=LogHistogram)
    joint: Histogram2D = field(default_factory=lambda: Histogram2D(-20.0, 0.0, 80))
    regression: np.ndarray = field(default_factory=lambda: np.zeros(6))  # n, x, x2, y, y2, xy
    signs: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))  # <0, 0, >0
    worst_tokens: list[dict[str, Any]] = field(default_factory=list)

    def update(self, batch: TokenBatch) -> None:
        """Add one chunk of whole sequences."""
        m = batch.loss_mask
        d = ops.log_ratio(batch)
        dm = torch.where(m, d, 0.0)
        train, rollout = batch.train.double(), batch.rollout.double()
        log_mid = torch.logaddexp(train, rollout) - math.log(2.0)
        a, b = train - log_mid, rollout - log_mid
        token = {
            "T": m.double(),
            "S": dm,
            "abs": dm.abs(),
            "d2": dm * dm,
            "k3": ops.k3(dm),
            "k3r": ops.k3_reverse(dm),
            "chi": torch.where(m, ops.exp(2.0 * d), 0.0),
            "mult": torch.where(m, torch.exp(d.abs()), 0.0),
            "js": torch.where(m, 0.5 * (ops.k3(a) + ops.k3(b)), 0.0),
            "rho": torch.where(m, torch.exp(d), 0.0),
            "rho2": torch.where(m, torch.exp(2.0 * d), 0.0),
            "train": torch.where(m, train, 0.0),
            "rollout": torch.where(m, rollout, 0.0),
        }
        stacked = torch.stack(list(token.values()), dim=1)
        sums = (
            torch.zeros(batch.num_sequences, stacked.shape[1], dtype=torch.float64, device=d.device)
            .index_add_(0, batch.seq_index, stacked)
            .cpu()
            .numpy()
        )
        for i, name in enumerate(token):
            self.seq[name].append(sums[:, i])
        self.seq["length"].append(batch.lengths.cpu().numpy().astype(np.float64))
        self.seq["max_abs"].append(ops.segment_max(d.abs(), batch, m).cpu().numpy())
        self.steps.append(batch.step.cpu().numpy())
        self.seq_ids.append(batch.seq_id)

        dl, rl = d[m], rollout[m]
        prob = torch.bucketize(
            rl.exp(),
            torch.tensor(PROB_EDGES[1:-1], dtype=torch.float64, device=d.device),
            right=True,
        )
        pos = log2_bucket(batch.positions()[m] + 1).clamp_(max=self.by_pos.shape[0] - 1)
        per_token = torch.stack([torch.ones_like(dl), dl.abs(), ops.k3(dl), dl], dim=1)
        for table, index in ((self.by_prob, prob), (self.by_pos, pos)):
            grouped = torch.zeros(table.shape, dtype=torch.float64, device=d.device)
            table += grouped.index_add_(0, index, per_token).cpu().numpy()
        self.abs_hist.update(dl.abs())
        self.joint.update(rl, train[m])
        self.regression += np.array(
            [dl.numel(), rl.sum(), (rl * rl).sum(), dl.sum(), (dl * dl).sum(), (rl * dl).sum()],
            dtype=np.float64,
        )
        self.signs += np.array([(dl < 0).sum(), (dl == 0).sum(), (dl > 0).sum()])
        self._keep_worst_tokens(batch, d, m)

    def _keep_worst_tokens(self, batch: TokenBatch, d: torch.Tensor, m: torch.Tensor) -> None:
        score = torch.where(m, d.abs(), -1.0)
        k = min(TOP_K, score.numel())
        top = torch.topk(score, k).indices.cpu()
        seq = batch.seq_index.cpu()[top]
        pos = batch.positions().cpu()[top]
        for t, s, p in zip(top.tolist(), seq.tolist(), pos.tolist(), strict=True):
            if float(score[t]) < 0:
                continue
            self.worst_tokens.append(
                {
                    "step": int(batch.step[s]),
                    "seq_id": batch.seq_id[s].as_py(),
                    "pos": int(p),
                    "rollout_logprob": float(batch.rollout[t]),
                    "train_logprob": float(batch.train[t]),
                    "d": float(d[t]),
                }
            )
        self.worst_tokens.sort(key=lambda row: -abs(row["d"]))
        del self.worst_tokens[TOP_K:]

    def merge(self, other: MismatchStats) -> None:
        """Add another accumulator's chunks after these (order is kept)."""
        for name in _SEQ_FIELDS:
            self.seq[name].extend(other.seq[name])
        self.steps.extend(other.steps)
        self.seq_ids.extend(other.seq_ids)
        self.by_prob += other.by_prob
        self.by_pos += other.by_pos
        self.abs_hist.merge(other.abs_hist)
        self.joint.merge(other.joint)
        self.regression += other.regression
        self.signs += other.signs
        self.worst_tokens = sorted(
            self.worst_tokens + other.worst_tokens, key=lambda row: -abs(row["d"])
        )[:TOP_K]

    def sequences(self) -> dict[str, np.ndarray]:
        """The per-sequence sums, one array per field, plus `step` and `seq_id`."""
        out = {k: np.concatenate(v) if v else np.zeros(0) for k, v in self.seq.items()}
        out["step"] = np.concatenate(self.steps) if self.steps else np.zeros(0, np.int64)
        out["seq_id"] = pa.concat_arrays(self.seq_ids) if self.seq_ids else pa.array([])
        return out

    def compute(self) -> dict[str, Any]:
        """Every statistic: overall, `by_step`, `by_length`, `by_prob`, `by_pos`, the worst
        sequences and tokens, the 2-D histogram and the bug `flags`."""
        s = self.sequences()
        every = np.ones(s["T"].size, dtype=bool)
        result = _summarize(s, every)
        result["by_step"] = [
            {"step": int(step), **_summarize(s, s["step"] == step)} for step in np.unique(s["step"])
        ]
        result["by_length"] = self._by_length(s, result)
        result["by_prob"] = _bucket_rows(
            self.by_prob,
            [f"{lo:g}-{hi:g}" for lo, hi in itertools.pairwise(PROB_EDGES)],
        )
        # Position bucket b holds pos + 1 in [2^b, 2^(b+1)).
        result["by_pos"] = _bucket_rows(
            self.by_pos, [f"{2**b - 1}-{2 ** (b + 1) - 2}" for b in range(32)]
        )
        result["abs_diff_quantiles"] = {
            f"p{q * 100:g}": self.abs_hist.quantile(q) for q in (0.5, 0.9, 0.99, 0.999)
        }
        result["abs_diff_hist"] = self.abs_hist.coarse()
        result["joint_hist"] = {
            "edges": self.joint.edges().tolist(),
            "counts": self.joint.counts.tolist(),
            "x": "rollout_logprob",
            "y": "train_logprob",
        }
        result["worst_sequences"] = _worst_sequences(s)
        result["worst_tokens"] = list(self.worst_tokens)
        result["flags"] = _flags(result, self.regression, self.signs)
        return result

    @staticmethod
    def _by_length(s: dict[str, np.ndarray], overall: dict[str, Any]) -> list[dict[str, Any]]:
        """Per log2 bucket of T: the measured sequence ratios beside the independent-token
        expectation S ~ N(mu T, var T) at the dump's per-token mean and variance of d."""
        rows = []
        mu, var = overall["d_mean"], overall["d_var"]
        has = s["T"] > 0
        buckets = np.floor(np.log2(np.maximum(s["T"], 1))).astype(int)
        for b in np.unique(buckets[has]):
            sel = has & (buckets == b)
            T, S = s["T"][sel], s["S"][sel]
            t_mid = float(np.median(T))
            sd = math.sqrt(var * t_mid) if var > 0 else 0.0
            rows.append(
                {
                    "bucket": bucket_label(int(b)),
                    "length_lo": 2 ** int(b),
                    "length_hi": 2 ** (int(b) + 1) - 1,
                    "length_median": t_mid,
                    "sequences": int(sel.sum()),
                    "tokens": int(T.sum()),
                    "abs_diff_mean": float(s["abs"][sel].sum() / T.sum()),
                    "k3": float(s["k3"][sel].sum() / T.sum()),
                    "seq_ratio_median": float(np.exp(np.median(S))),
                    "seq_ratio_p10": float(np.exp(np.quantile(S, 0.1))),
                    "seq_ratio_p90": float(np.exp(np.quantile(S, 0.9))),
                    "geo_ratio_p10": float(np.exp(np.quantile(S / T, 0.1))),
                    "geo_ratio_p90": float(np.exp(np.quantile(S / T, 0.9))),
                    "expected_seq_ratio_median": math.exp(mu * t_mid),
                    "expected_seq_ratio_p10": math.exp(mu * t_mid - Z90 * sd),
                    "expected_seq_ratio_p90": math.exp(mu * t_mid + Z90 * sd),
                    "expected_geo_ratio_p10": math.exp(mu - Z90 * sd / t_mid),
                    "expected_geo_ratio_p90": math.exp(mu + Z90 * sd / t_mid),
                    "expected_ess_fraction": math.exp(-var * t_mid),
                }
            )
        return rows


def _summarize(s: dict[str, np.ndarray], sel: np.ndarray) -> dict[str, Any]:
    """The scalar statistics over the sequences `sel`."""
    n = float(s["T"][sel].sum())
    has = sel & (s["T"] > 0)
    if n == 0:
        return {"tokens": 0, "sequences": int(has.sum())}

    def tok(name: str) -> float:
        return float(s[name][sel].sum() / n)

    T = s["T"][has]
    G = s["S"][has] / T
    d_mean = tok("S")
    d_var = max(tok("d2") - d_mean * d_mean, 0.0)
    return {
        "tokens": int(n),
        "sequences": int(has.sum()),
        "k1": -d_mean,
        "k2": 0.5 * tok("d2"),
        "k3": tok("k3"),
        "k3_reverse": tok("k3r"),
        "chi2_token": tok("chi") - 1.0,
        "chi2_seq": float(np.mean(np.exp(2.0 * np.clip(s["S"][has], -20.0, 20.0)))) - 1.0,
        "abs_diff_mean": tok("abs"),
        "abs_diff_max": float(s["max_abs"][has].max()),
        "token_mult_prob_error": tok("mult"),
        "js": tok("js"),
        "log_ppl_diff": float(np.mean(-G)),
        "log_ppl_abs_diff": float(np.mean(np.abs(G))),
        "log_ppl_diff_max": float(np.max(-G)),
        "log_ppl_diff_min": float(np.min(-G)),
        "ppl_ratio": float(np.mean(np.exp(-G))),
        "training_ppl": float(np.mean(np.exp(-s["train"][has] / T))),
        "rollout_ppl": float(np.mean(np.exp(-s["rollout"][has] / T))),
        "ratio_mean": tok("rho"),
        "ratio_mean_stderr": math.sqrt(max(tok("rho2") - tok("rho") ** 2, 0.0) / n),
        "d_mean": d_mean,
        "d_var": d_var,
    }


def _bucket_rows(table: np.ndarray, labels: list[str]) -> list[dict[str, Any]]:
    rows = []
    for label, (tokens, abs_sum, k3_sum, d_sum) in zip(labels, table, strict=False):
        if tokens:
            rows.append(
                {
                    "bucket": label,
                    "tokens": int(tokens),
                    "abs_diff_mean": abs_sum / tokens,
                    "k3": k3_sum / tokens,
                    "d_mean": d_sum / tokens,
                }
            )
    return rows


def _worst_sequences(s: dict[str, np.ndarray]) -> list[dict[str, Any]]:
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


def _flags(result: dict[str, Any], regression: np.ndarray, signs: np.ndarray) -> list[dict]:
    """Signatures of semantics bugs, as opposed to numerical noise (ecosystem.md section 2)."""
    flags = []
    if not result.get("tokens"):
        return flags
    ratio, se = result["ratio_mean"], result["ratio_mean_stderr"]
    z = (ratio - 1.0) / se if se > 0 else 0.0
    if abs(z) > 6.0 and abs(ratio - 1.0) > 0.005:
        flags.append(
            {
                "code": "ratio_mean_bias",
                "message": f"<exp(d)> = {ratio:.4f} (z = {z:+.0f}): it must be 1 when tokens are "
                "sampled from the rollout engine and both sides score the same distribution. "
                "Typical causes: processed (top-p/top-k/temperature) log-probs on one side and raw "
                "on the other, a token shift, or stale weights.",
            }
        )
    n, x, x2, y, y2, xy = regression
    cov = xy / n - (x / n) * (y / n)
    var_x, var_y = x2 / n - (x / n) ** 2, y2 / n - (y / n) ** 2
    corr = cov / math.sqrt(var_x * var_y) if var_x > 0 and var_y > 0 else 0.0
    result["d_rollout_correlation"] = corr
    if abs(corr) > 0.3:
        flags.append(
            {
                "code": "logprob_dependent_offset",
                "message": f"d is correlated with the rollout log-prob (r = {corr:+.2f}): "
                "numerical noise is symmetric at every probability. A temperature applied on "
                "one side only (or different temperatures) makes d grow linearly with the "
                "log-prob.",
            }
        )
    negative, _, positive = signs.astype(float)
    one_sided = max(negative, positive) / max(negative + positive, 1.0)
    result["d_sign_fraction"] = one_sided
    if one_sided > 0.8 and abs(result["d_mean"]) > 3.0 * math.sqrt(result["d_var"] / n):
        side = "below" if negative > positive else "above"
        flags.append(
            {
                "code": "constant_offset",
                "message": f"{one_sided:.0%} of the tokens have d {side} 0 (mean d = "
                f"{result['d_mean']:+.4f}): a one-sided offset is a semantics bug (e.g. raw vs "
                "processed log-probs, renormalization after top-p), not numerical noise.",
            }
        )
    steps = result.get("by_step", [])
    if len(steps) >= 3 and steps[0].get("k3", 0) > 0:
        growth = steps[-1]["k3"] / steps[0]["k3"]
        result["k3_growth"] = growth
        if growth > 3.0:
            flags.append(
                {
                    "code": "drift",
                    "message": f"k3 grows {growth:.1f}x from step {steps[0]['step']} to step "
                    f"{steps[-1]['step']}: mismatch that drifts during training points to a "
                    "divergence between the engines (weight sync, resume, growing off-policyness).",
                }
            )
    return flags
