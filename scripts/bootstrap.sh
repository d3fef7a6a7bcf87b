#!/usr/bin/env bash
# Set up a fresh machine: system packages (when root and missing) and .venv with pdserve,
# its CPU torch (pinned: an unpinned torch pulls a multi-GB CUDA build) and the dev tools.
# Safe to re-run: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || need+=(libibverbs1)  # Mooncake TE links it, even for TCP
command -v redis-server >/dev/null || need+=(redis-server)
command -v kubectl >/dev/null || need+=(kubernetes-client)  # `kubectl kustomize` in tests/deploy
if ((${#need[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "bootstrap: apt-get install ${need[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "bootstrap: please install ${need[*]} (not root or no apt-get)" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] && ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "bootstrap: pdserve needs Python 3.11 or newer; $PY is $("$PY" -V 2>&1). Run again with PYTHON=python3.11 (or newer)" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.pdserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing pdserve into .venv (first time: a few minutes)"
  .venv/bin/python -m pip install -q -U pip
  .venv/bin/python -m pip install -q -e ".[cpu,triton,dev]"
  touch "$stamp"
fi
