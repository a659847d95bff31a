"""The mismatch statistics by name: what each one is (`DEFINITIONS`), the names each framework
logs it under (`METRIC_NAMES`, so the values can be matched with W&B charts) and the healthy
ranges the frameworks publish for it (`BANDS`, in words)."""

from __future__ import annotations

from iscore import frameworks

_STATISTICS = (
    "k1", "k2", "k3", "k3_reverse", "chi2_token", "chi2_seq", "abs_diff_mean", "abs_diff_max",
    "token_mult_prob_error", "js", "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio",
    "training_ppl", "rollout_ppl", "ratio_mean", "ess",
)  # fmt: skip


_ELSEWHERE = {"k3": ("blogs: vllm-kl",)}  # names used outside the frameworks' own logs


METRIC_NAMES: dict[str, list[str]] = {
    statistic: [
        f"{fw.title} {name}" for fw in frameworks.every() for name in fw.metrics.get(statistic, ())
    ]
    + list(_ELSEWHERE.get(statistic, ()))
    for statistic in _STATISTICS
}
"""For each statistic, the names the frameworks log it under
(docs/corrections.md#mismatch-diagnostics).

Where a framework averages per sequence first (slime's mis_*), its value differs from the
token average iscore reports; the name says so.
"""


BANDS: dict[str, list[str]] = {
    statistic: [
        f"{fw.title} {band.logged_as}: {band.describe()}"
        for fw in frameworks.every()
        for band in fw.bands
        if band.statistic == statistic
    ]
    for statistic in _STATISTICS
}
"""For each statistic, the healthy ranges the frameworks' docs publish (`Framework.bands`, the
bands `iscore.advice.health` judges by), in words."""


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
    "token_mult_prob_error": "<e^|d|>_tok: 1 where the two sides agree on every token",
    "js": "<(e^a - 1 - a)/2 + (e^b - 1 - b)/2>_tok with a = train - log m, b = rollout - log m, "
    "m = (e^train + e^rollout)/2",
    "log_ppl_diff": "<-G>_seq = log-PPL(train) - log-PPL(rollout)",
    "log_ppl_abs_diff": "<|G|>_seq",
    "ppl_ratio": "<e^-G>_seq",
    "training_ppl": "<exp(-mean train_logprob)>_seq",
    "rollout_ppl": "<exp(-mean rollout_logprob)>_seq",
    "ratio_mean": "<e^d>_tok: exactly 1 in expectation when tokens are sampled from the rollout "
    "engine and both log-probs are of the same distribution",
    "ess": "<e^d>_tok^2 / <e^2d>_tok: the effective sample size of the raw ratios, as a fraction "
    "of the loss tokens",
}
