#!/usr/bin/env bash
# The README's first command: set everything up, start router + prefill + decode on a tiny
# model, send one real request through the OpenAI API, and keep serving until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/pdserve up --example-request "$@"
