#!/usr/bin/env bash
# Fetch into .whl/ the wheels the lent H200's image lacks (cp312, manylinux x86-64), at the
# versions this checkout's .venv runs, so bench/h200.sh can install them there (PyPI is not
# reachable from the device). Usage: bash scripts/device_wheels.sh [--mooncake]
#   --mooncake  also the Mooncake CUDA wheel (~40 MB; for the `pd` part, not for cuda_ipc runs)
# Then name `.whl` in the device call's carry.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
ver() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null; }
pkgs=()
for p in fastapi starlette pydantic pydantic-core pydantic-settings python-dotenv uvicorn \
  annotated-types typing-inspection grpcio grpcio-health-checking protobuf redis xgrammar \
  apache-tvm-ffi py-spy opentelemetry-api typing-extensions peft accelerate psutil; do
  if v=$(ver "$p"); then
    pkgs+=("$p==$v")
  else
    echo "device_wheels: $p is not installed in .venv: left out" >&2  # py-spy: the bench's profiles only
  fi
done
[ "${1:-}" = "--mooncake" ] && pkgs+=("mooncake-transfer-engine-cuda13==0.3.14")
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pkgs[@]}"
du -sh .whl
ls .whl
