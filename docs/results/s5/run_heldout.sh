#!/bin/bash
# Held-out reading, once per final candidate (defaults at the commit named in the log: candidate features on).
# usage: [OUT=docs/results/s5/FILE.jsonl] bash docs/results/s5/run_heldout.sh > docs/results/s5/FILE.log 2>&1
cd "$(dirname "$0")/../../.." && . .venv/bin/activate
export RMM_DATA_DIR=${RMM_DATA_DIR:-../shared/data} HF_HUB_OFFLINE=1 WANDB_MODE=disabled
OUT=${OUT:-docs/results/s5/final_heldout.jsonl}
echo "# commit $(git rev-parse --short HEAD) $(date -u +%H:%M) load $(cut -d' ' -f1 /proc/loadavg)"
for spec in "msc turn hybrid" "locomo turn hybrid" "locomo session hybrid" "locomo topic hybrid" \
            "msc topic hybrid" "msc session hybrid" "locomo turn bm25:minilm" "msc turn bm25:minilm" \
            "locomo session bm25:minilm" "locomo topic bm25:minilm" "msc topic bm25:minilm" "msc session bm25:minilm"; do
  set -- $spec
  python scripts/reranker_ablations.py --dataset $1 --granularity $2 --retriever $3 --read-heldout --run final \
    --threads 1 --out "$OUT" 2>&1 | grep -v "Building index\|Loading weights"
done
echo "# done $(date -u +%H:%M) load $(cut -d' ' -f1 /proc/loadavg)"
