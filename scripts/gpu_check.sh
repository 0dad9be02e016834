#!/usr/bin/env bash
# GPU check: the GPU-marked tests and the GPU benchmarks, summarised in one markdown report.
#
#   scripts/gpu_check.sh [REPORT.md]          # default: gpu-report.md in the current directory
#
# Run from the repository root (or anywhere: it cd's there) on a machine with a CUDA device, in an
# environment with rmm, pytest and triton installed (the Dockerfile.cuda image has them:
# `docker run --rm --gpus all -v $PWD:/out --entrypoint scripts/gpu_check.sh rmm:cuda /out/gpu-report.md`).
# Exit status: 0 when the GPU tests pass, 1 when any fails, 2 when there is no usable GPU.
# Figures are measured, never assumed: without a GPU the script stops before benchmarking.
set -uo pipefail

report="$(realpath -m "${1:-gpu-report.md}")"
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}" WANDB_MODE="${WANDB_MODE:-disabled}"
unset TRITON_INTERPRET   # compiled kernels here, not the CPU interpreter
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$(dirname "$report")"

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to torch (torch.cuda.is_available() is False)" >&2
  printf '# rmm GPU check\n\nNo CUDA device was visible (%s); nothing was measured.\n' "$(date -u +%FT%TZ)" > "$report"
  exit 2
fi

python - > "$work/env.md" <<'PY'
import platform, torch
try:
    import triton; tv = triton.__version__
except Exception as exc:
    tv = f"not importable ({type(exc).__name__})"
try:
    import faiss; fg = f"{faiss.__version__}, GPUs visible to faiss: {faiss.get_num_gpus()}"
except Exception:
    fg = "not importable"
props = torch.cuda.get_device_properties(0)
print(f"- device: {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}")
print(f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}, faiss {fg}")
print(f"- bf16 supported: {torch.cuda.is_bf16_supported()}; python {platform.python_version()}")
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=driver_version --format=csv,noheader | sed 's/^/- driver: /' >> "$work/env.md"

echo "== GPU-marked tests" >&2
start=$(date +%s)
python -m pytest -q -m gpu -rs -p no:cacheprovider tests/ --junitxml="$work/gpu-tests.xml" 2>&1 | tee "$work/tests.log"
tests_status=${PIPESTATUS[0]}
tests_secs=$(( $(date +%s) - start ))
# pytest exit 5 = no tests collected; treat as a failure here (the GPU tests exist)
summary="$(grep -E '(passed|failed|error|skipped|no tests ran)' "$work/tests.log" | tail -1)"

echo "== benchmarks" >&2
python scripts/bench_kernels.py --device cuda --out "$work/bench.json" --markdown "$work/bench.md" 2> "$work/bench.log"
bench_status=$?
[ $bench_status -ne 0 ] && tail -20 "$work/bench.log" >&2

{
  echo "# rmm GPU check — $(date -u +%FT%TZ)"
  echo
  if rev="$(git rev-parse --short HEAD 2>/dev/null)"; then
    git diff --quiet HEAD 2>/dev/null || rev="$rev (with local changes)"
  else
    rev="unknown (not a git checkout)"
  fi
  echo "git: $rev"
  echo
  cat "$work/env.md"
  echo
  echo "## GPU-marked tests"
  echo
  echo "\`pytest -m gpu\`: ${summary:-no summary line} (exit ${tests_status}, ${tests_secs}s)"
  echo
  if [ $bench_status -eq 0 ]; then
    cat "$work/bench.md"
  else
    echo "## Benchmarks"; echo; echo "bench_kernels.py failed (exit $bench_status):"; echo '```'; tail -20 "$work/bench.log"; echo '```'
  fi
} > "$report"
[ $bench_status -eq 0 ] && cp "$work/bench.json" "${report%.md}.json"
echo "report: $report" >&2

if [ "$tests_status" -ne 0 ] || [ "$bench_status" -ne 0 ]; then
  exit 1
fi
exit 0
