"""Run scripts/reranker_ablations.py with rmm.policy.optimizer.LEXICAL_LR_SCALE set to argv[1] (training stream only)."""
import runpy, sys
sys.path.insert(0, "/work/main/scripts")
import rmm.policy.optimizer as optimizer
scale = float(sys.argv[1])
optimizer.LEXICAL_LR_SCALE = scale
sys.argv = ["reranker_ablations.py", *sys.argv[2:]]
runpy.run_path("/work/main/scripts/reranker_ablations.py", run_name="__main__")
