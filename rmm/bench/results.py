"""docs/results.md's tables, measured at one commit: what each table holds, running what is missing,
and the Markdown of every table with each row's own command beside it.

    python -m rmm.bench.results run [SECTION ...]     # measure the rows this commit has not measured yet
    python -m rmm.bench.results table SECTION          # print one table (Markdown), from its JSON
    python -m rmm.bench.results render docs/results.md [--check]   # rewrite (or check) its tables

A section is one table: a list of jobs, each one `python -m rmm.bench.ablations …` (or the fusion
program) over one bank with one or more `--run`s; every row it writes records its own one-run command
and the commit it ran at (`rmm.bench.ablations.commit`). `run` skips a job whose rows the section's
file already holds for this commit, so an interrupted run resumes; `table` refuses a file whose rows
come from different commits. Held-out figures are read by the `heldout` section only, once per final
candidate: the other sections run the training stream (`--read-heldout` is not given), so no choice
read from them has seen a held-out question.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rmm.bench.ablation_table import arrow, headline_table, heldout_table, one_commit, pct, prequential_table
from rmm.bench.ablations import commit

log = logging.getLogger("rmm.bench.results")
OUT = Path(__file__).resolve().parents[2] / "docs" / "results"


@dataclass(frozen=True)
class Job:
    """One process: a program over one bank with its runs (each run is one row of the table)."""

    argv: tuple[str, ...]
    runs: tuple[str, ...] = ()
    where: tuple[str, str, str, int | None] = ("locomo", "minilm", "turn", None)  # dataset, retriever, memories, limit

    def command(self, out: Path) -> list[str]:
        if self.argv[:2] == ("-m", "rmm"):  # an `rmm` command writes its own report (`--json`)
            return [sys.executable, *self.argv, "--json", str(out)]
        runs = [arg for spec in self.runs for arg in ("--run", spec)]
        return [sys.executable, *self.argv, *runs, "--out", str(out)]


@dataclass(frozen=True)
class Section:
    """One table of docs/results.md: its JSON file under docs/results/ and the jobs that fill it."""

    name: str
    kind: str  # "headline" | "prequential" | "fusion" | "pipeline"
    jobs: tuple[Job, ...] = field(default_factory=tuple)

    @property
    def path(self) -> Path:
        return OUT / f"{self.name}.jsonl"


def _ablations(dataset: str, retriever: str, granularity: str, *runs: str, limit: int | None = None,
               heldout: bool = False) -> Job:
    argv = ["-m", "rmm.bench.ablations", "--dataset", dataset, "--retriever", retriever, "--granularity", granularity]
    argv += ["--limit", str(limit)] if limit else []
    argv += ["--read-heldout"] if heldout else []
    return Job((*argv, "--threads", "1"), runs, (dataset, retriever, granularity, limit))


FIRST_STAGES = ("bm25:minilm", "minilm", "hybrid")
PRETRAINED = "runs/pretrain/minilm-locomo-cpu/encoder"  # configs/pretrain/minilm-locomo-cpu.yaml's output
GRANULARITIES = ("turn", "session", "topic")

# Training-stream ablations of the reranker's recipe (τ, lr, credit, baseline, per-user) and of the
# lexical feature's starting weight; then the lexical feature's definitions per memory kind.
RECIPE_RUNS = ("base", "tau0.5:tau=0.5", "tau0.2:tau=0.2", "tau0.02:tau=0.02", "lr1e-3:lr=0.001",
               'credit-seq:credit="sequence"', 'credit-rtg:credit="reward-to-go"', "baseline0.5:baseline=0.5",
               "per-user:per_user=true")
LEXICAL_RUNS = ("nolex:lexical_feature=false", "w0:lexical_init=0", "w0.3:lexical_init=0.3",
                "w1:lexical_init=1", "w3:lexical_init=3", "tau0.1:tau=0.1", "tau0.2:tau=0.2")
DEFINITION_RUNS = ('fused-w0.3:feature="fused"', 'fused-w1:feature="fused",lexical_init=1',
                   'fused-depth-w0.3:feature="fused-depth"', 'bm25-cos-w1:feature="bm25-cos",lexical_init=1',
                   "bm25-w0.3:lexical_init=0.3", "bm25-w1:lexical_init=1", "nocand:candidate_features=false")

SECTIONS = {s.name: s for s in (
    Section("fusion", "fusion", (Job(("research/choose_fusion.py", "--dataset", "locomo", "--dense", "minilm")),)),
    Section("ablations_locomo", "prequential", (
        _ablations("locomo", "minilm", "turn", *RECIPE_RUNS),
        _ablations("locomo", "hybrid", "turn", *RECIPE_RUNS[:5], *LEXICAL_RUNS),
        _ablations("locomo", "hybrid", "session", *LEXICAL_RUNS[:5]),
    )),
    Section("ablations_msc", "prequential", (
        _ablations("msc", "minilm", "turn", *RECIPE_RUNS, limit=3000),
        _ablations("msc", "hybrid", "turn", "base", *LEXICAL_RUNS, limit=3000),
    )),
    Section("lexical_definition", "prequential", tuple(
        _ablations("locomo", "hybrid", g, *DEFINITION_RUNS) for g in GRANULARITIES)
        + (_ablations("msc", "hybrid", "turn", *DEFINITION_RUNS, limit=3000),)),
    # The whole pipeline (issue 35 item 11): `rmm pretrain --config configs/pretrain/minilm-locomo-cpu.yaml`
    # first (it writes PRETRAINED; it holds out rmm train's held-out conversations), then online training.
    Section("pipeline", "pipeline", tuple(
        Job(("-m", "rmm", "train", "--config", "configs/train/online-minilm-cpu.yaml", "plot=null", "--retriever",
             retriever), where=("locomo", retriever, "turn", None))
        for retriever in (PRETRAINED, f"hybrid:{PRETRAINED}"))),
    Section("heldout", "headline", tuple(
        _ablations(d, r, g, "final", heldout=True) for d in ("locomo", "msc") for g in GRANULARITIES
        for r in FIRST_STAGES)),
)}


def rows(section: Section) -> list[dict]:
    if not section.path.exists():
        return []
    return [json.loads(line) for line in section.path.read_text().splitlines() if line.strip()]


def done(section: Section, job: Job, at: str | None) -> bool:
    """Every run of `job` already has a row at commit `at`."""
    held = {(r.get("dataset"), r.get("retriever"), r.get("granularity"), r.get("limit"), r.get("name"))
            for r in rows(section) if r.get("commit") == at}
    if section.kind == "fusion":
        return bool(held)
    if section.kind == "pipeline":
        return (*job.where, "pipeline") in held
    return all((*job.where, spec.partition(":")[0]) in held for spec in job.runs)


def run(names: list[str]) -> int:
    at = commit()
    if at is None or at.endswith("-dirty"):
        log.warning("measuring at %s: commit first, or the rows cannot name the code that made them", at)
    root = OUT.parents[1]
    for name in names:
        section = SECTIONS[name]
        section.path.parent.mkdir(parents=True, exist_ok=True)
        stale = [r for r in rows(section) if r.get("commit") != at]
        if stale:  # a table is one commit's: rows of another commit leave the file (git keeps them)
            log.info("%s: dropping %d rows of other commits", name, len(stale))
            section.path.write_text("".join(json.dumps(r) + "\n" for r in rows(section) if r.get("commit") == at))
        for job in section.jobs:
            if done(section, job, at):
                log.info("%s: done already: %s", name, " ".join(job.argv))
                continue
            if section.kind == "pipeline":
                if _run_report(section, job, at, root):
                    return 1
                continue
            log.info("%s: %s", name, " ".join(job.command(section.path)[1:]))
            if subprocess.run(job.command(section.path), cwd=root).returncode:
                log.error("%s failed: %s", name, " ".join(job.argv))
                return 1
    return 0


def _run_report(section: Section, job: Job, at: str | None, root: Path) -> int:
    """Run an `rmm` command that writes a JSON report; append it as one row with its command and commit."""
    report = section.path.with_suffix(".report.json")
    command = job.command(report)
    log.info("%s: %s", section.name, " ".join(command[1:]))
    if subprocess.run(command, cwd=root).returncode:
        log.error("%s failed: %s", section.name, " ".join(job.argv))
        return 1
    dataset, retriever, granularity, limit = job.where
    row = {"name": "pipeline", "dataset": dataset, "retriever": retriever, "granularity": granularity, "limit": limit,
           "command": shlex.join(["rmm", *job.argv[2:]]), "commit": at, "report": json.loads(report.read_text())}
    with section.path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    report.unlink()
    return 0


def pipeline_table(found: list[dict]) -> list[str]:
    """Held-out figures of `rmm train` runs: the retriever alone and reranked, at M, with R@K and R@T."""
    out = ["| first stage | questions | R@5 alone | R@5 + reranker | lift | R@20 | R@15t alone → + reranker | "
           "nDCG@5 alone → + reranker | command |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in found:
        alone, reranked = r["report"]["retriever_heldout"], r["report"]["reranker_heldout"]
        m, k = r["report"]["config"]["eval_k"], r["report"]["config"]["k"]
        pair = {f"base {key}": alone.get(key) for key in alone} | {f"reranked {key}": reranked.get(key) for key in reranked}
        out.append(f"| {r['retriever']} | {alone['n']} | {pct(alone[f'recall@{m}'])} | {pct(reranked[f'recall@{m}'])} | "
                   f"{pct(reranked[f'recall@{m}'] - alone[f'recall@{m}'], True)} | {pct(alone[f'recall@{k}'])} | "
                   f"{arrow(pair, 'recall_turns@15')} | {arrow(pair, f'ndcg@{m}')} | `{r['command']}` |")
    return out


def fusion_table(found: list[dict]) -> list[str]:
    out = ["| rule | R@5 | R@20 | nDCG@5 | questions | command |", "|---|---:|---:|---:|---:|---|"]
    out += [f"| {r['rule']} | {100 * r['recall@5']:.1f} | {100 * r['recall@20']:.1f} | {100 * r['ndcg@5']:.1f} | "
            f"{r['questions']} | `{r['command']}` |" for r in found]
    return out


def table(name: str) -> list[str]:
    section = SECTIONS[name]
    found = rows(section)
    if not found:
        raise SystemExit(f"error: {section.path} holds no rows; measure them: python -m rmm.bench.results run {name}")
    at = one_commit(found)
    render = {"fusion": fusion_table, "prequential": prequential_table, "headline": headline_table,
              "pipeline": pipeline_table}[section.kind]
    return [f"Measured at commit {at}; JSON: `docs/results/{section.path.name}`.", "", *render(found)]


BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.DOTALL)


def render(text: str) -> str:
    """`text` with every `<!-- table: NAME -->` … `<!-- /table -->` block rebuilt from its JSON (NAME
    a section, or `heldout-per-category`), so no figure in the document is typed by hand."""

    def rebuilt(match: re.Match) -> str:
        name = match["name"]
        if name == "heldout-per-category":
            found = rows(SECTIONS["heldout"])
            lines = [f"Measured at commit {one_commit(found)}.", "", *heldout_table(found)]
        else:
            lines = table(name)
        return match[1] + "\n".join(lines) + "\n" + match[4]

    return BLOCK.sub(rebuilt, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    measure = sub.add_parser("run", help="measure the rows this commit has not measured yet")
    measure.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of {', '.join(SECTIONS)} (default: all)")
    show = sub.add_parser("table", help="print one table as Markdown")
    show.add_argument("section", choices=list(SECTIONS))
    show.add_argument("--per-category", action="store_true", help="held-out: every category, not the headline")
    doc = sub.add_parser("render", help="rebuild a document's table blocks from their JSON")
    doc.add_argument("document", type=Path)
    doc.add_argument("--check", action="store_true", help="exit 1 if a table differs from its JSON; write nothing")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.verb == "run":
        unknown = sorted(set(args.sections) - set(SECTIONS))
        if unknown:
            parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
        raise SystemExit(run(args.sections or list(SECTIONS)))
    if args.verb == "render":
        before = args.document.read_text()
        after = render(before)
        if args.check:
            if after != before:
                raise SystemExit(f"{args.document}: a table differs from its JSON; python -m rmm.bench.results "
                                 f"render {args.document}")
            return
        args.document.write_text(after)
        return
    if args.per_category:
        found = rows(SECTIONS[args.section])
        lines = [f"Measured at commit {one_commit(found)}.", "", *heldout_table(found)]
    else:
        lines = table(args.section)
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
