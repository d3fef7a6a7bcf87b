#!/usr/bin/env bash
# Regenerate the gRPC stubs from proto/ into pdserve/rpc/ (or into $1 for the no-diff test).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -Iproto --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  proto/pdserve/rpc/node.proto
