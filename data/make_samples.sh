#!/usr/bin/env bash
# Regenerate the bundled sample dumps (deterministic: fixed seeds). Run from the repository root
# with iscore installed: bash data/make_samples.sh
set -euo pipefail
cd "$(dirname "$0")"
iscore simulate dense_bf16.parquet    --regime dense_bf16    --sequences 56 --steps 2 --seed 1
iscore simulate fp8.parquet           --regime fp8           --sequences 48 --seed 2
iscore simulate moe_routing.parquet   --regime moe_routing   --sequences 64 --seed 3
iscore simulate offset_bug.parquet    --regime offset_bug    --sequences 48 --seed 4
iscore simulate drift.parquet         --regime drift         --sequences 12 --steps 4 --seed 5
iscore simulate long_collapse.parquet --regime long_collapse --sequences 18 --seed 6
iscore simulate off_policy.parquet    --regime moe_routing   --sequences 48 --policy-sigma 0.1 --seed 7
