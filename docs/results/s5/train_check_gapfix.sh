#!/bin/bash
# training streams only, after the cosine_gap fix: candidate features on vs off
cd /work/main && . .venv/bin/activate
export RMM_DATA_DIR=/work/shared/data HF_HUB_OFFLINE=1 WANDB_MODE=disabled
echo "# commit $(git rev-parse --short HEAD) $(date -u +%H:%M) load $(cut -d' ' -f1 /proc/loadavg)"
for spec in "msc turn" "locomo turn" "locomo session" "locomo topic" "msc topic"; do
  set -- $spec
  python scripts/reranker_ablations.py --dataset $1 --retriever hybrid --granularity $2 --run on --run off:candidate_features=false --threads 1 --out /work/main/docs/results/s5/train_check_gapfix.jsonl 2>&1 | grep -v "Building index\|Loading weights"
done
echo "# done $(date -u +%H:%M)"
