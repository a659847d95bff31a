"""The pandas baseline: the corrections and every statistic `analyze` reports, written as a
dataframe user would, in float64 with per-sequence sums by groupby.

It is an independent implementation of the same math as the engine (`iscore.frameworks`,
`iscore.stats.mismatch`, `iscore.stats.histogram`), never calling its replay, so that agreeing with
it checks the engine, and timing it shows what the same work costs in pandas.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from iscore.frameworks.areal import ArealCorrection
from iscore.frameworks.fireworks import FireworksTIS
from iscore.frameworks.nemo_rl import NemoRLSpec
from iscore.frameworks.openrlhf import OpenRLHFCorrection
from iscore.frameworks.skyrl import SkyRLSpec
from iscore.frameworks.slime import SlimeCorrection
from iscore.frameworks.trl import TRLCorrection
from iscore.frameworks.verl import VerlSpec
from iscore.packed import TokenBatch
from iscore.stats import (
    BIN_SAMPLE,
    BINS_PER_DECADE,
    CLIP,
    FAR,
    LOG10_RANGE,
    MAD_SD,
    SCALE_EDGES,
    SPAN_RATIO,
    SPREAD_FLOOR,
    TOP_K,
    TRUNCATION_TOLERANCE,
    WINDOW,
    Noise,
    aggregation_of,
    outside,
)

if TYPE_CHECKING:
    from pandas.api.typing import DataFrameGroupBy


def frame(batch: TokenBatch) -> pd.DataFrame:
    """One row per token: sequence, step, log-probs (float64) and loss mask."""
    return pd.DataFrame(
        {
            "seq": np.repeat(np.arange(batch.num_sequences), batch.lengths.numpy()),
            "step": np.repeat(batch.step.numpy(), batch.lengths.numpy()),
            "rollout": batch.rollout.numpy().astype(np.float64),
            "train": batch.train.numpy().astype(np.float64),
            "mask": batch.loss_mask.numpy(),
        }
    )


def statistics(df: pd.DataFrame, specs: list[Any]) -> dict[str, Any]:
    """The settings' weights and the statistics with pandas: per-sequence sums by groupby.

    Beside the key statistics (checked against iscore), it computes what else `analyze`
    reports, so the workloads match: the other mismatch estimators (token and sequence
    level, overall and per step), per-probability, per-position and per-length tables, the
    histograms of |d|, of signed d and of (rollout, train) log-probs, the correlation and
    sign balance of d, the worst tokens and sequences, the noise and the broken sequences
    and the spans of large |d| (`_noise`); per setting the truncated and rejected fractions,
    per-step and per-length tables, the histograms of the weights and raw ratios beside their
    quantiles (exact, where iscore reads them off the histograms), and the broken sequences'
    gradient kept.
    """
    d = df["train"] - df["rollout"]
    m = df["mask"]
    terms = _token_terms(df, d, m)
    grouped = terms.groupby("seq")
    per_seq = _per_sequence(df, grouped)
    n = per_seq["m"].sum()
    mismatch = _mismatch(df, d, m, terms, per_seq, n)
    broken = _noise(df, d, m, per_seq, mismatch)
    count = grouped["m"].transform("sum")
    settings = [_setting(spec, df, d, m, count, per_seq, n, broken) for spec in specs]
    return {"mismatch": mismatch, "settings": settings}


def _token_terms(df: pd.DataFrame, d: pd.Series, m: pd.Series) -> pd.DataFrame:
    """Each token's summands of the mismatch estimators, 0 outside the loss mask, by sequence."""
    dm = d.where(m, 0.0)
    rho = np.exp(d).where(m, 0.0)
    mid = np.logaddexp(df["train"], df["rollout"]) - math.log(2.0)
    a, b = df["train"] - mid, df["rollout"] - mid
    return pd.DataFrame(
        {
            "seq": df["seq"],
            "m": m.astype(float),
            "d": dm,
            "abs": dm.abs(),
            "d2": dm * dm,
            "k3": (np.expm1(dm) - dm),
            "k3r": (np.expm1(-dm) + dm),
            "chi": np.exp(2 * d.clip(-20, 20)).where(m, 0.0),
            "mult": np.exp(d.abs()).where(m, 0.0),
            "js": (0.5 * (np.expm1(a) - a + np.expm1(b) - b)).where(m, 0.0),
            "rho": rho,
            "rho2": rho * rho,
            "train": df["train"].where(m, 0.0),
            "rollout": df["rollout"].where(m, 0.0),
        }
    )


def _per_sequence(df: pd.DataFrame, grouped: DataFrameGroupBy) -> pd.DataFrame:
    """The sequences with loss tokens: their summed terms, largest |d| and step."""
    per_seq = grouped.sum()
    per_seq["max_abs"] = grouped["abs"].max()
    per_seq["step"] = df.groupby("seq")["step"].first()
    return per_seq[per_seq["m"] > 0]


def _mismatch(
    df: pd.DataFrame,
    d: pd.Series,
    m: pd.Series,
    terms: pd.DataFrame,
    per_seq: pd.DataFrame,
    n: float,
) -> dict[str, Any]:
    """The mismatch estimators over the `n` loss tokens, their breakdowns and d's distribution."""
    token = per_seq.drop(columns=["step", "max_abs"]).sum() / n
    G = per_seq["d"] / per_seq["m"]
    sequence = _sequence_terms(per_seq, G)
    return {
        "k3": token["k3"],
        "k3_reverse": token["k3r"],
        "chi2_token": token["chi"] - 1,
        "token_mult_prob_error": token["mult"],
        "js": token["js"],
        "ratio_mean": token["rho"],
        "ratio_mean_stderr": np.sqrt((token["rho2"] - token["rho"] ** 2) / n),
        "d_var": token["d2"] - token["d"] ** 2,
        "abs_diff_mean": token["abs"],
        "abs_diff_max": per_seq["max_abs"].max(),
        **sequence.drop(columns=["step"]).mean(),
        "chi2_seq": sequence["chi2_seq"].mean() - 1,
        **_breakdowns(df, terms, per_seq, sequence, G),
        **_distribution(df, d, m, per_seq),
    }


def _sequence_terms(per_seq: pd.DataFrame, G: pd.Series) -> pd.DataFrame:
    """Each sequence's step and its sequence-level estimators, from its mean d `G`."""
    return pd.DataFrame(
        {
            "step": per_seq["step"],
            "chi2_seq": np.exp(2 * per_seq["d"].clip(-20, 20)),
            "log_ppl_diff": -G,
            "log_ppl_abs_diff": G.abs(),
            "ppl_ratio": np.exp(-G),
            "training_ppl": np.exp(-per_seq["train"] / per_seq["m"]),
            "rollout_ppl": np.exp(-per_seq["rollout"] / per_seq["m"]),
        }
    )


def _breakdowns(
    df: pd.DataFrame,
    terms: pd.DataFrame,
    per_seq: pd.DataFrame,
    sequence: pd.DataFrame,
    G: pd.Series,
) -> dict[str, Any]:
    """The mismatch tables by step, rollout probability, position and sequence length."""
    columns = ["m", "abs", "k3", "d"]
    return {
        "by_step": terms.groupby(df["step"]).sum(),
        "by_step_sequences": sequence.groupby("step").agg(["mean", "max", "min"]),
        "by_prob": terms.groupby(pd.cut(np.exp(df["rollout"]), [0, 0.01, 0.1, 0.5, 0.9, 0.99, 1]))[
            columns
        ].sum(),
        "by_pos": terms.groupby(np.floor(np.log2(df.groupby("seq").cumcount() + 1)))[columns].sum(),
        "by_length": pd.DataFrame({"S": per_seq["d"], "G": G, "T": per_seq["m"]})
        .groupby(np.floor(np.log2(per_seq["m"])))
        .quantile([0.1, 0.5, 0.9]),
    }


def _distribution(
    df: pd.DataFrame, d: pd.Series, m: pd.Series, per_seq: pd.DataFrame
) -> dict[str, Any]:
    """The loss tokens' d: quantiles and histograms, correlation and sign balance, the worst."""
    loss = d[m]
    abs_loss = loss.abs()
    return {
        "abs_quantiles": abs_loss.quantile([0.5, 0.9, 0.99, 0.999]),
        "abs_hist": _log_histogram(abs_loss),
        "neg_hist": _log_histogram(abs_loss[loss < 0]),
        "joint_hist": np.histogram2d(
            df["rollout"][m].clip(-20, 0), df["train"][m].clip(-20, 0), 80, [(-20, 0), (-20, 0)]
        )[0],
        "d_rollout_correlation": np.corrcoef(df["rollout"][m], loss)[0, 1],
        "d_sign_fraction": max((loss < 0).sum(), (loss > 0).sum()) / max((loss != 0).sum(), 1),
        "worst_tokens": df.loc[abs_loss.nlargest(TOP_K).index],
        "worst_sequences": per_seq.nlargest(TOP_K, "k3"),
    }


def _setting(
    spec: Any,
    df: pd.DataFrame,
    d: pd.Series,
    m: pd.Series,
    count: pd.Series,
    per_seq: pd.DataFrame,
    n: float,
    broken: pd.Series,
) -> dict[str, Any]:
    """One setting's statistics over the `n` loss tokens, with the gradient `broken` keeps."""
    weight, kept, raw, pre = WEIGHTS[type(spec)](spec, df, d, m, count)
    w = weight.where(m, 0.0)
    s = _setting_sequences(df, m, w, kept, raw, pre, per_seq)
    total, squares = s["w"].sum(), s["w2"].sum()
    tables = ["w", "w2", "nz", "kept", "high", "low", "T"]
    length = s.groupby(np.floor(np.log2(s["T"])))
    quantiles = [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999]
    return {
        "weight_mean": total / n,
        "weight_mean_seq": s["seq_weight"].mean(),
        "token_masked_fraction": 1 - s["nz"].sum() / n,
        "token_rejected_fraction": 1 - s["kept"].sum() / n,
        "truncated_high_fraction": s["high"].sum() / n,
        "truncated_low_fraction": s["low"].sum() / n,
        "seq_masked_fraction": (s["nz"] == 0).mean(),
        "lr_scale": _lr_scale(spec, s, total, n),
        "ess": total * total / (n * squares),
        "by_step": s.groupby("step")[tables].sum(),
        "by_length": length[tables].sum(),
        "by_length_quantiles": length["seq_weight"].quantile([0.1, 0.5, 0.9]),
        "by_length_medians": length[["T", "seq_raw"]].median(),
        "broken_gradient_kept": s["w"][broken].sum() / s["T"][broken].sum()
        if broken.any()
        else None,
        "weight_quantiles": w[m].quantile(quantiles),
        "raw_quantiles": raw[m].quantile(quantiles),
        "weight_hist": _log_histogram(w[m]),
        "raw_hist": _log_histogram(raw[m]),
    }


def _setting_sequences(
    df: pd.DataFrame,
    m: pd.Series,
    w: pd.Series,
    kept: pd.Series,
    raw: pd.Series,
    pre: pd.Series,
    per_seq: pd.DataFrame,
) -> pd.DataFrame:
    """Per sequence with loss tokens: the sums of the weights `w` and the counts of the tokens
    kept, nonzero and truncated (`pre` against `raw`), its length, step and mean weights."""
    kept = kept & m
    changed = kept & (pre > 0)
    sums = pd.DataFrame(
        {
            "seq": df["seq"],
            "w": w,
            "w2": w * w,
            "nz": ((w > 0) & m),
            "kept": kept,
            "high": changed & (pre < raw * (1 - TRUNCATION_TOLERANCE)),
            "low": changed & (pre > raw * (1 + TRUNCATION_TOLERANCE)),
            "log_raw": np.log(raw.clip(lower=1e-300)).where(m, 0.0),
        }
    )
    s = sums.groupby("seq").sum()
    s["T"] = per_seq["m"]
    s = s[s["T"] > 0]
    s["step"] = per_seq["step"]
    s["seq_weight"] = s["w"] / s["T"]
    s["seq_raw"] = s["log_raw"] / s["T"]
    return s


def _lr_scale(spec: Any, s: pd.DataFrame, total: float, n: float) -> float:
    """The scale the setting's loss aggregation gives the learning rate: its mean weight over
    the sequences (`s`), the kept tokens or all `n` loss tokens."""
    agg = aggregation_of(spec)
    if agg.mode == "seq-mean-token-mean":
        return s["seq_weight"].mean()
    if agg.shrinks:
        return total / s["kept"].sum()
    return total / n


def _noise(
    df: pd.DataFrame, d: pd.Series, m: pd.Series, per_seq: pd.DataFrame, out: dict[str, Any]
) -> pd.Series:
    """The noise workload of `iscore.stats.noise` and `iscore.stats.attribution`, into `out`: per
    step the median and MAD of the loss tokens' d and the histogram of |d|; per step and bin of
    rollout probability (`SCALE_EDGES`) those of an evenly strided sample of its tokens
    (`BIN_SAMPLE`) and each token's distance from them; per sequence its median d, its tokens either
    side of 0 and far ones (`FAR`), whether it is broken (`noise.outside`, per-sequence arithmetic
    on those), and the span ratio of its worst window of |d|. The broken sequences, bool per
    sequence with loss tokens."""
    loss = d[m]
    seq, step = df["seq"][m], df["step"][m]
    ints = pd.DataFrame({"seq": seq, "step": step})
    ints["bin"] = np.searchsorted(np.log(SCALE_EDGES), df["rollout"][m], side="right")
    center = loss.groupby(step).median()
    spread = MAD_SD * (loss - step.map(center)).abs().groupby(step).median()
    out["step_hists"] = {s: _log_histogram(loss[step == s].abs()) for s in center.index}
    keys = [ints["step"], ints["bin"]]
    rank = ints.groupby(["step", "bin"]).cumcount()
    size = ints.groupby(["step", "bin"])["seq"].transform("size")
    sampled = rank % np.maximum(size // BIN_SAMPLE, 1) == 0
    bin_keys = [k[sampled] for k in keys]
    bin_center = loss[sampled].groupby(bin_keys).median()
    at = pd.MultiIndex.from_arrays(keys)
    token_center = bin_center.reindex(at).to_numpy()
    bin_spread = (
        MAD_SD * (loss[sampled] - token_center[sampled.to_numpy()]).abs().groupby(bin_keys).median()
    )
    scale = np.maximum(bin_spread.reindex(at).to_numpy(), SPREAD_FLOOR)
    far = (np.abs(loss.to_numpy() - token_center) / scale > FAR).astype(float)
    sequences = pd.DataFrame(
        {
            "median": loss.groupby(seq).median(),
            "positive": (loss > 0).groupby(seq).sum(),
            "negative": (loss < 0).groupby(seq).sum(),
            "far": pd.Series(far, index=loss.index).groupby(seq).sum(),
        }
    )
    sequences["T"] = per_seq["m"]
    sequences["step"] = per_seq["step"]
    broken = pd.Series(False, index=sequences.index)
    for s, group in sequences.groupby("step"):
        noise = Noise(center[s], spread[s], int(group["T"].sum()))
        columns = [group[k].to_numpy(dtype=float) for k in ("median", "T", "positive", "negative")]
        broken[group.index] = outside(*columns, group["far"].to_numpy(), noise)
    out["d_median_by_step"], out["d_spread_by_step"] = center.tolist(), spread.tolist()
    out["broken_sequences"] = int(broken.sum())
    # Span ratios: each sequence's worst window of WINDOW tokens' |d| (clipped at CLIP times
    # its step's mean), over that mean; a sequence shorter than a window, its own mean.
    mean = loss.abs().groupby(step).mean()
    clipped = np.minimum(loss.abs(), CLIP * step.map(mean))
    total = clipped.groupby(seq).cumsum()
    window = (total - total.groupby(seq).shift(WINDOW, fill_value=0.0)) / WINDOW
    window = window[ints.groupby("seq").cumcount() >= WINDOW - 1]
    best = window.groupby(seq[window.index]).max().reindex(sequences.index)
    short = sequences["T"] < WINDOW
    best[short] = clipped.groupby(seq).mean()[short]
    ratio = best / sequences["step"].map(mean)
    out["span_sequences"] = int(((ratio > SPAN_RATIO) & ~broken).sum())
    return broken


def _log_histogram(x: pd.Series) -> dict[str, Any]:
    """The counts of `LogHistogram` (log-spaced bins, zeros, tails, extremes) with numpy."""
    values = x.to_numpy()
    logs = np.log10(values[values > 0])
    lo, hi = LOG10_RANGE
    counts, _ = np.histogram(logs, bins=int((hi - lo) * BINS_PER_DECADE), range=(lo, hi))
    return {
        "counts": counts,
        "zeros": int((values == 0).sum()),
        "underflow": int((logs < lo).sum()),
        "overflow": int((logs >= hi).sum()),
        "min": values.min(initial=np.inf),
        "max": values.max(initial=-np.inf),
    }


def verl(spec: VerlSpec, df, d, m, count):
    """As `padded.verl`, in float64."""
    (rs,) = spec.rs
    k1 = (-d.clip(-20, 20)).where(m, 0.0)
    mean = k1.groupby(df["seq"]).transform("sum") / count.clip(lower=1.0)
    keep = (mean >= math.log(rs.lower)) & (mean <= math.log(rs.upper)) & m
    raw = np.exp(d.clip(-20, 20))
    weight = raw.clip(upper=spec.is_upper).where(keep, 0.0)
    return weight, keep, raw, weight


def skyrl(spec: SkyRLSpec, df, d, m, count):
    """As `padded.skyrl`, in float64."""
    rho = np.exp(d.clip(-20, 20))
    low, high = spec.outlier_token_is_threshold_low, spec.outlier_token_is_threshold_high
    outlier = (((rho < low) | (rho > high)) & m).groupby(df["seq"]).transform("any")
    low, high = spec.token_mask_is_threshold_low, spec.token_mask_is_threshold_high
    keep = m & ~outlier & (rho >= low) & (rho <= high)
    k = keep.astype(float)
    num = (d * k).groupby(df["seq"]).transform("sum")
    den = k.groupby(df["seq"]).transform("sum").clip(lower=1.0)
    geo = np.exp((num / den).clip(-20, 20))
    keep = keep & (geo >= spec.geo_mask_low) & (geo <= spec.geo_mask_high)
    weight = rho.clip(upper=spec.token_tis_ratio_clip_high).where(keep, 0.0)
    return weight, keep, rho, weight


def nemo(spec: NemoRLSpec, df, d, m, count):
    """As `padded.nemo`, in float64 (0 where the float32 ratio would overflow)."""
    rho = np.exp(d)
    rho = rho.where(np.isfinite(rho.astype(np.float32)), 0.0)
    lower = spec.truncated_importance_sampling_ratio_min
    upper = spec.truncated_importance_sampling_ratio
    weight = rho.where((rho >= lower) & (rho <= upper), 0.0)
    return weight, m, rho, weight


def slime(spec: SlimeCorrection, df, d, m, count):
    """As `padded.slime`, in float64."""
    mis = spec.mis
    ratio = np.exp(d.clip(-20, 20))
    weight = ratio.clip(0.0, mis.tis_upper_bound)
    veto = math.log(np.float32(mis.rs_veto_threshold))
    vetoed = ((d < veto) & m).groupby(df["seq"]).transform("any")
    keep = m & (ratio >= mis.rs_lower) & (ratio <= mis.rs_upper) & ~vetoed
    wm = weight.where(m, 0.0)
    step_sum = wm.groupby(df["step"]).transform("sum")
    step_count = m.astype(float).groupby(df["step"]).transform("sum").clip(lower=1.0)
    mean = step_sum / step_count
    mean = mean.where(mean > 1e-8, 1.0)
    return (weight / mean).where(keep, 0.0), keep, ratio, weight


def areal(spec: ArealCorrection, df, d, m, count):
    """As `padded.areal`, in float64."""
    rs = spec.rejection_sampling
    lower = 0.0 if rs.lower is None else rs.lower
    d = d.where(np.isfinite(d), 0.0)
    mean = d.where(m, 0.0).groupby(df["seq"]).transform("sum") / count.clip(lower=1.0)
    ratio = np.exp(mean)
    keep = m & (ratio >= lower) & (ratio <= rs.upper)
    weight = ratio.where(keep, 0.0)
    return weight, keep, ratio, weight


def openrlhf(spec: OpenRLHFCorrection, df, d, m, count):
    """As `padded.openrlhf`, in float64."""
    rho = np.exp(d)
    weight = rho.where((rho >= spec.lower) & (rho <= spec.upper), 0.0)
    return weight, m, rho, weight


def trl(spec: TRLCorrection, df, d, m, count):
    """As `padded.trl`: the float64 sum, e^S rounded to float32 as TRL computes it."""
    lower = 0.0 if spec.clip_min is None else spec.clip_min
    upper = math.inf if spec.clip_max is None else spec.clip_max
    total = d.where(m, 0.0).groupby(df["seq"]).transform("sum")
    ratio = np.exp(total).astype(np.float32).astype(np.float64)
    weight = ratio.where((ratio >= lower) & (ratio <= upper), 0.0)
    return weight, m, ratio, weight


def fireworks(spec: FireworksTIS, df, d, m, count):
    """As `padded.fireworks`, in float64."""
    raw = np.exp(d.clip(-20, 20))
    weight = raw.clip(0.0, spec.cap)
    return weight, m, raw, weight


WEIGHTS = {
    VerlSpec: verl,
    SkyRLSpec: skyrl,
    NemoRLSpec: nemo,
    SlimeCorrection: slime,
    ArealCorrection: areal,
    OpenRLHFCorrection: openrlhf,
    TRLCorrection: trl,
    FireworksTIS: fireworks,
}
"""Each framework's (weight, kept, raw ratio, weight before batch normalization) per token,
for the settings `implements` accepts."""
