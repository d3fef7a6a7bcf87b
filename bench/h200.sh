#!/usr/bin/env bash
# Everything the GPU issue measures, in one call on the lent H200 (its time is short):
#
#   bash bench/h200.sh [PART ...]   PART: decode pd pytest pytest-async pytest-rest pytest-files
#                                         kernels attn attn-prefill decode-quick startup prefill ipc
#                                         pd-ipc served gemv-l2 grammar sampling spec
#                                   (pytest-files: the tests named in $PYTEST_FILES)
#                                   (default: decode pd pytest)
#
# Runs from the repository root with PYTHONPATH=. (no install). Wheels the image lacks (the
# Mooncake CUDA wheel; grpcio / protobuf / grpcio-health-checking matching the generated stubs)
# are taken from .whl/ when present (bench/README.md says how to fetch them). Each part has its
# own time limit and log; a failing part does not stop the others. Logs and JSON go to $OUT
# (the device tool's output folder), else bench/results/h200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pdserve-site .whl/*.whl && export PYTHONPATH=.:/tmp/pdserve-site
fi
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} >"$OUT/device.log" 2>&1
cat "$OUT/device.log"

# MPS=1: run every part under CUDA MPS (one daemon for the machine, started here and stopped at
# the end), so the processes of one GPU (P/D's prefill and decode nodes) run kernels side by side
# instead of taking turns in time slices. Skipped, with a line, where it does not start.
if [ "${MPS:-0}" = 1 ]; then
  if nvidia-cuda-mps-control -d && python3 -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
    echo "CUDA MPS on" | tee -a "$OUT/device.log"
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
  else
    echo "CUDA MPS could not start: the parts run without it" | tee -a "$OUT/device.log"
    echo quit | nvidia-cuda-mps-control 2>/dev/null
  fi
fi

part() {  # part NAME LIMIT_S CMD...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"
  tail -n "${TAIL:-30}" "$OUT/$name.log"
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(decode pd pytest)
for p in "${parts[@]}"; do
  case $p in
    decode) part gpu_decode "${DECODE_LIMIT:-290}" python3 bench/gpu_decode.py --out "$OUT" \
      --modes graphs graphs-sync --hf-caches ${HF_CACHES:-dynamic} --skip-micro --profile-replays ;;
    pd) part gpu_pd "${PD_LIMIT:-150}" python3 bench/gpu_pd.py --out "$OUT" ;;
    spec) part spec "${SPEC_LIMIT:-300}" python3 bench/spec.py --device cuda --models tiny smollm2 \
      --out "$OUT/spec.json" ;;
    pytest) part pytest_gpu "${PYTEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider \
      tests/gpu tests/kernels tests/engine/test_async_scheduling.py -rfE --tb=short ;;
    pytest-async) part pytest_async "${PYTEST_LIMIT:-150}" python3 -m pytest -v -p no:cacheprovider \
      tests/gpu/test_async_cuda.py -rfE --tb=short ;;
    pytest-rest) part pytest_rest "${PYTEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider \
      tests/gpu tests/kernels tests/engine/test_async_scheduling.py -rfE --tb=short \
      --ignore=tests/gpu/test_async_cuda.py ;;
    gemv-l2) part gemv_l2 "${GEMV_LIMIT:-60}" python3 bench/gpu_gemv_l2.py --out "$OUT" ;;
    attn-prefill) part attn_prefill "${ATTN_LIMIT:-90}" python3 bench/gpu_attn_prefill.py --out "$OUT" ;;
    attn) part attn_sweep "${ATTN_LIMIT:-240}" python3 bench/gpu_diagnose.py --out "$OUT" --no-traces ;;
    decode-quick) part gpu_decode_quick "${DECODE_LIMIT:-150}" python3 bench/gpu_decode.py --out "$OUT" \
      --modes graphs --skip-transformers --skip-micro --profile-replays --batches 1 64 ;;
    pytest-files) part pytest_files "${PYTEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider \
      $PYTEST_FILES -rfE --tb=short ;;
    startup) part startup 120 python3 bench/startup.py ;;
    prefill) part gpu_prefill "${PREFILL_LIMIT:-330}" python3 bench/gpu_prefill.py --out "$OUT" ${PREFILL_ARGS:-} ;;
    ipc) part gpu_ipc "${IPC_LIMIT:-90}" python3 bench/gpu_ipc.py --out "$OUT" ;;
    pd-ipc) part gpu_pd_ipc "${PD_LIMIT:-150}" python3 bench/gpu_pd.py --out "$OUT" --transport cuda_ipc ;;
    served) part served "${SERVED_LIMIT:-560}" python3 bench/served.py --out "$OUT/served.json" --device cuda \
      --shape llama-1b --dtype bfloat16 --prompt-tokens 512 --max-tokens 128 --ignore-eos \
      --concurrency 1 16 64 256 --reps 1 --requests-per-level 2 --client-procs 8 --skip-vllm \
      --kv-transport cuda_ipc ${SERVED_ARGS:-} ;;
    grammar) part grammar "${GRAMMAR_LIMIT:-300}" bash bench/h200_grammar.sh "$OUT" ;;
    sampling) part gpu_sampling "${SAMPLING_LIMIT:-200}" python3 bench/gpu_sampling.py --out "$OUT" ;;
    kernels) part kernels "${KERNELS_LIMIT:-120}" python3 bench/gpu_kernels.py --out "$OUT/kernels.json" ;;
    *) echo "unknown part $p" >&2 ;;
  esac
done
