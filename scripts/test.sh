#!/usr/bin/env bash
# The project's one test command (CI runs exactly this through .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check pdserve services tests bench
.venv/bin/ruff format --check pdserve services tests bench
.venv/bin/mypy pdserve services
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
