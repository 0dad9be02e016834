#!/bin/bash
# H4: the missing final-table rows, one after another (2 shared cores: one thread each).
cd /tmp/h4tree && . /work/main/.venv/bin/activate && export PYTHONPATH=/tmp/h4tree
export RMM_DATA_DIR=/work/shared/data HF_HUB_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
OUT=/work/notes/s4/final_heldout.jsonl
LOGS=/work/notes/s4/h4
row() {  # dataset retriever granularity [--alone]
  local tag="$1-$2-$3${4:+-alone}"; tag=${tag//:/_}
  echo "== $(date -u +%T) start $tag load $(cut -d' ' -f1 /proc/loadavg)" >> $LOGS/progress.log
  if [ "$4" = "--alone" ]; then
    python scripts/reranker_ablations.py --dataset $1 --retriever $2 --granularity $3 --alone --threads 1 --out $OUT
  else
    python scripts/reranker_ablations.py --dataset $1 --retriever $2 --granularity $3 --read-heldout --run final --threads 1 --out $OUT
  fi 2>&1 | grep -v "Building index from token IDs\|Loading weights" > $LOGS/$tag.log
  echo "== $(date -u +%T) done $tag rc ${PIPESTATUS[0]} load $(cut -d' ' -f1 /proc/loadavg)" >> $LOGS/progress.log
}
row locomo bm25:minilm turn
row locomo bm25:minilm session
row locomo bm25:minilm topic
row locomo bm25:minilm topic --alone
row msc bm25:minilm turn
row msc bm25 session --alone
row msc minilm session
row msc hybrid session
row msc bm25:minilm session
row msc bm25:minilm topic --alone
row msc bm25:minilm topic
echo "== $(date -u +%T) all done" >> $LOGS/progress.log
