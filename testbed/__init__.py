"""Proof by training: does a correction setting train well, not only look good on a dump?

A tiny autoregressive policy learns a toy task with policy gradients on CPU, its rollouts
sampled by a perturbed copy of itself (engine noise, heavy tails, a stale replica, long
sequences). Each candidate setting is applied exactly as iscore replays it (`spec.replay` on
the batch as a `TokenBatch`) under its framework's loss aggregation, over several seeds per
regime, and the final rewards are compared seed by seed (docs/recommend.md#proof-by-training).

- `testbed.task`: the task, the policy (many runs side by side) and its exact expected reward;
- `testbed.engine`: the regimes and the perturbed rollout engine;
- `testbed.training`: the training loop and the policy-gradient loss;
- `testbed.sweep`: each regime's candidates (the recommendation's among them) and the cache;
- `testbed.table`: the statistics and the tables;
- `python -m testbed sweep`: all of it, printed as the Markdown table.
"""
