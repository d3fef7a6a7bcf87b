#!/usr/bin/env bash
# The project's one test command (CI runs exactly this through .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
PDSERVE_TRITON=1 bash scripts/bootstrap.sh  # triton: the kernel tests run it under TRITON_INTERPRET=1
.venv/bin/ruff check pdserve services tests bench
.venv/bin/ruff format --check pdserve services tests bench
.venv/bin/mypy pdserve services
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
