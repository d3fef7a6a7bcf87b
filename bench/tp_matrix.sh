#!/usr/bin/env bash
# TP with KV transfer, the whole matrix between real node processes (CPU, gloo ranks, Mooncake TCP):
# greedy parity with transformers for (prefill, decode) = (tp1, tp1), (tp2, tp1), (tp1, tp2),
# (tp2, tp2), (pp2, tp2), (tp2, pp2), then a killed decode TP rank. Each pair starts its own
# cluster (~30-90 s each on 2 cores). Extra arguments go to pytest (e.g. -k tp2-tp1).
set -euo pipefail
cd "$(dirname "$0")/.."
PDSERVE_FULL_TESTS=1 exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 \
  tests/e2e/test_tp_pd_e2e.py "$@"
