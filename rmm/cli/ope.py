"""`rmm ope LOGS TARGET`: would TARGET have done better than the policy that served the logged traffic?

LOGS is where rewarded, sampled (`explore=true`) selections are kept:

- a bank folder of `rmm serve` (its `selections.sqlite`), or that file itself;
- a `postgresql://` bank (its `selections` table: every replica's traffic);
- an `rmm train --output` run folder: a training run keeps no selection log, only the records
  waiting in each learner's batch buffer (at most a batch per learner); they are used when they
  were sampled by the checkpoint's own weights (recomputed log μ matches), the others are skipped.

Rewarded rows are read as stored at sampling time (`rmm.serve.selection_rows`); greedy rows
(`explore=false`: no sampling probability), rows without a parseable citation, rows an older rmm
wrote without τ or embeddings, and rows whose stored scores do not reproduce their logged log μ are
counted and skipped. `rmm serve` sweeps rewarded rows one `selection_ttl_s` after a checkpoint
holds their feedback, so the logs reach back about that far.

TARGET is a reranker checkpoint folder, a run folder (its shared reranker), a bank folder (its
`reranker/`), or a baseline: `uniform` or `retriever` (an untrained reranker: what rmm serves before
it learns). A checkpoint samples at its own τ unless `--tau`; baselines at each row's logged τ.
`--greedy` evaluates serving the target's top M without exploration.
The estimators and their assumptions are `rmm.ope`'s.

`rmm ope --server URL --api-key KEY` asks a running `rmm serve` (through `rmm.serve.client`) for its
shadow reranker's running estimate against the live policy (`GET /v1/ope`); with `--promote` it asks
the server to swap the live weights for the shadow's (`POST /v1/reranker/promote`), which it does only
when the shadow's lower bound clears the live value. Either way both figures are printed; exit 0 on
promotion, 1 on a refusal (one line: why, with both figures), 2 on an error (server unreachable, a key
that is not an admin's, no shadow configured). The key must be an admin tenant's (`shadow.admin_tenants`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any

from rmm.cli.arguments import add_check, non_negative_int, open_fraction, positive_float, positive_int, probability
from rmm.cli.common import add_verbose, console, write_json
from rmm.errors import RmmError

__all__ = ["register", "run"]

log = logging.getLogger(__name__)

SELECTIONS_FILE = "selections.sqlite"  # rmm.serve.service.SELECTIONS_FILE (not imported: keeps --help fast)
BANK_RERANKER = "reranker"  # rmm.serve.service.CHECKPOINT_DIR
API_KEY_ENV = "RMM_API_KEY"
_MISMATCH_TOL = 1e-3  # |recomputed log μ − logged| above which a row's scores are not what it was sampled from


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("ope", help="off-policy evaluation: a reranker's value on logged selections",
                              description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="?",
                   help="bank folder, selections.sqlite, postgresql:// URL, or `rmm train --output` folder")
    p.add_argument("target", nargs="?", help="checkpoint folder, run folder, bank folder, `uniform` or `retriever`")
    p.add_argument("--server", metavar="URL", help="ask a running rmm serve for its shadow's estimate instead "
                                                   "(GET /v1/ope) of reading logs here")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"an admin tenant's key for --server (default ${API_KEY_ENV})")
    p.add_argument("--promote", action="store_true",
                   help="with --server: promote the shadow to serve if its lower bound clears the live value "
                        "(POST /v1/reranker/promote); exit 0 promoted, 1 refused")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="--server request timeout, seconds")
    p.add_argument("--tau", type=positive_float, help="the target's sampling temperature (default: a checkpoint's "
                                                      "own; baselines: each row's logged τ)")
    p.add_argument("--greedy", action="store_true", help="evaluate the target's top M (explore=false)")
    p.add_argument("--key", help="only selections of this reranker key (a user or tenant learner)")
    p.add_argument("--limit", type=positive_int, help="the newest N selections only")
    p.add_argument("--clip", type=positive_float, default=10.0, help="weight cap of ips-clipped (default 10)")
    p.add_argument("--bootstrap", type=positive_int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--level", type=open_fraction, default=0.95, help="interval level (default 0.95)")
    p.add_argument("--folds", type=positive_int, default=5, help="cross-fitting folds of the dr reward model")
    p.add_argument("--ridge", type=positive_float, default=1.0, help="ridge strength of the dr reward model")
    p.add_argument("--samples", type=positive_int, default=1000,
                   help="Monte Carlo races per selection where exact inclusion is too costly (default 1000)")
    p.add_argument("--exact-limit", type=non_negative_int, default=None,
                   help="largest exact-programme size (Σ C(K,m)·m) before Monte Carlo (default rmm.ope's)")
    p.add_argument("--min-ess", type=positive_float, default=10.0,
                   help="refuse below this effective sample size (shown memories; default 10)")
    p.add_argument("--max-unsupported", type=probability, default=0.01,
                   help="refuse when the target puts more than this share of its picks where the logging "
                        "policy could not show (default 0.01)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", help="write the figures as JSON")
    add_verbose(p)
    add_check(p, _check_mode)
    p.set_defaults(func=run)


def _check_mode(args: argparse.Namespace) -> str | None:
    """Either LOGS and TARGET (evaluate here) or --server (ask a running server), never both."""
    if args.server is None:
        if args.promote:
            return "--promote needs --server URL (the running rmm serve whose shadow to promote)"
        if args.logs is None or args.target is None:
            return "give LOGS and TARGET, or --server URL"
        return None
    if args.logs is not None:
        return "--server asks a running server: give no LOGS or TARGET with it"
    if not args.api_key:
        return f"--server needs --api-key (or ${API_KEY_ENV}): an admin tenant's key"
    return None


# ---- reading logs ----------------------------------------------------------------------------------
class Skipped(dict[str, int]):
    """Rows left out, counted by why (printed under the table and written to --json)."""

    def add(self, why: str) -> None:
        self[why] = self.get(why, 0) + 1


def _decoded(raw: list[Any], fmt: Any, load: Any, skipped: Skipped) -> list[Any]:
    """Stored rows (newest first) as `LoggedSelection`s, oldest first: undecodable rows and rows whose
    stored scores do not reproduce their logged log μ are counted in `skipped`, not used."""
    from rmm.ope import behaviour_mismatch
    from rmm.serve.errors import CorruptSelectionError
    from rmm.serve.selection_rows import SELECTION_COLUMNS, selection_from_row

    n = len(SELECTION_COLUMNS)
    rows = []
    for r in reversed(raw):
        try:
            pending = selection_from_row(r[:n], fmt)
        except CorruptSelectionError:
            skipped.add("stored corrupt")
            continue
        row = _logged(pending, None if r[n] is None else load(r[n]), skipped)
        if row is not None and behaviour_mismatch([row])[0] > _MISMATCH_TOL:
            skipped.add("stored scores do not reproduce the logged μ")
        elif row is not None:
            rows.append(row)
    return rows


def _logged(pending: Any, feedback: dict[str, Any] | None, skipped: Skipped) -> Any | None:
    """A stored selection and its feedback as a `LoggedSelection`, or None (counted in `skipped`)."""
    from rmm.ope import logged_from_selection
    from rmm.serve.feedback import rebuild

    if not pending.explore:
        skipped.add("greedy (explore=false)")
    elif feedback is None or feedback.get("rewards") is None:
        skipped.add("no parseable citation")
    elif pending.embeddings is None or pending.tau is None or pending.logp is None:
        skipped.add("written by an older rmm (no embeddings, τ or μ)")
    elif not pending.chosen:
        skipped.add("nothing shown")
    else:
        return logged_from_selection(rebuild(pending), feedback["rewards"])
    return None


def _sqlite_rows(path: Path, key: str | None, limit: int | None, skipped: Skipped) -> list[Any]:
    from rmm.serve.selection_rows import SELECTION_COLUMNS, SQLITE_FORMAT

    if not path.is_file():
        raise RmmError(f"no selection log at {path} (rmm serve writes {SELECTIONS_FILE} beside its bank)")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        where = "consumed_at IS NOT NULL" + (" AND reranker_key = ?" if key is not None else "")
        sql = f"SELECT {', '.join(SELECTION_COLUMNS)}, feedback FROM selections WHERE {where} ORDER BY created_at DESC"
        sql += f" LIMIT {int(limit)}" if limit else ""
        raw = conn.execute(sql, (key,) if key is not None else ()).fetchall()
    except sqlite3.DatabaseError as exc:
        raise RmmError(f"{path} is not a readable selection log: {exc}") from exc
    finally:
        conn.close()
    return _decoded(raw, SQLITE_FORMAT, json.loads, skipped)


def _pg_rows(url: str, key: str | None, limit: int | None, skipped: Skipped) -> list[Any]:
    from rmm.memory.pg_database import PgDatabase
    from rmm.serve.selection_rows import SELECTION_COLUMNS, RowFormat

    fmt = RowFormat(dump_json=json.dumps, load_json=list, dump_bool=bool)  # JSONB read back as lists, BOOLEAN
    db = PgDatabase(url)
    try:
        where = "consumed_at IS NOT NULL" + (" AND reranker_key = %s" if key is not None else "")
        sql = f"SELECT {', '.join(SELECTION_COLUMNS)}, feedback FROM selections WHERE {where} ORDER BY created_at DESC"
        sql += f" LIMIT {int(limit)}" if limit else ""
        with db.tx() as cur:
            raw = cur.execute(sql, (key,) if key is not None else ()).fetchall()
    finally:
        db.close()
    return _decoded(raw, fmt, dict, skipped)


def _checkpoints(root: Path) -> list[Path]:
    return sorted({meta.parent for meta in root.rglob("meta.json") if not meta.parent.name.startswith(".")})


def _run_rows(folder: Path, skipped: Skipped) -> list[Any]:
    """The records buffered in a training run's checkpoints that its own weights sampled (module docstring)."""
    import torch

    from rmm.ope import LoggedSelection, behaviour_mismatch
    from rmm.policy.checkpoint import read_checkpoint
    from rmm.policy.learner import Learner
    from rmm.policy.rewarded import RewardedSelection

    rows = []
    for path in _checkpoints(folder / "rerankers"):
        reranker = Learner.load(path).reranker
        for state in read_checkpoint(path).training["pending"]:
            if "behaviour_logp" not in state:
                skipped.add("buffered by an older rmm (no μ)")
                continue
            record = RewardedSelection.from_state(state)
            with torch.no_grad():
                lexical = None if record.lexical is None or reranker.lexical_weight is None else record.lexical[None]
                feats = (None if record.features is None or reranker.feature_weight is None
                         else record.features[None])
                scores = reranker.fast_scores(record.query[None], record.memories[None], lexical, feats)[0]
            row = LoggedSelection(query=record.query.float(), memories=record.memories.float(), scores=scores.float(),
                                  tau=float(record.tau), chosen=record.chosen.long(),
                                  rewards=record.rewards.float(), behaviour_logp=record.behaviour_logp.float(),
                                  mask=record.mask, lexical=record.lexical, features=record.features,
                                  feature_names=reranker.feature_names if record.features is not None else (),
                                  id=f"{path.name}:{len(rows)}")
            if behaviour_mismatch([row])[0] > _MISMATCH_TOL:
                skipped.add("sampled by earlier weights than the run's checkpoint")
                continue
            rows.append(row)
    return rows


def read_logs(location: str, key: str | None = None, limit: int | None = None) -> tuple[list[Any], Skipped, str]:
    """The usable logged selections at `location`, what was skipped and why, and what kind of log it was."""
    skipped = Skipped()
    if location.startswith(("postgresql://", "postgres://")):
        return _pg_rows(location, key, limit, skipped), skipped, "postgresql"
    path = Path(location)
    if path.is_file():
        return _sqlite_rows(path, key, limit, skipped), skipped, "sqlite"
    if (path / "state.json").is_file() and (path / "rerankers").is_dir():
        rows = _run_rows(path, skipped)
        return rows[-limit:] if limit else rows, skipped, "training run"
    if path.is_dir():
        return _sqlite_rows(path / SELECTIONS_FILE, key, limit, skipped), skipped, "sqlite"
    raise RmmError(f"no logs at {location}: expected a bank folder, {SELECTIONS_FILE}, a postgresql:// URL or an "
                   "`rmm train --output` folder")


# ---- the target ------------------------------------------------------------------------------------
def load_target(spec: str, rows: list[Any], tau: float | None, greedy: bool) -> Any:
    """The target policy `spec` names (module docstring)."""
    from rmm.ope import RerankerTarget, UniformTarget, retriever_target
    from rmm.policy.checkpoint import checkpoint_exists
    from rmm.policy.learner import Learner

    if spec == "uniform":
        if greedy:
            raise RmmError("--greedy with the uniform target has no top M to take")
        return UniformTarget()
    if spec == "retriever":
        return retriever_target(rows, tau=tau, greedy=greedy)
    path = Path(spec)
    for candidate in (path, path / "rerankers", path / BANK_RERANKER):
        if checkpoint_exists(candidate):
            learner = Learner.load(candidate)
            return RerankerTarget(learner.reranker, tau=learner.config.tau if tau is None else tau, greedy=greedy,
                                  name=str(candidate))
    found = _checkpoints(path) if path.is_dir() else []
    hint = f"; checkpoints under it: {', '.join(map(str, found[:5]))}" if found else ""
    raise RmmError(f"target {spec!r} is not a reranker checkpoint, a run or bank folder with a shared one, "
                   f"`uniform` or `retriever`{hint}")


# ---- report ----------------------------------------------------------------------------------------
def _print(report: Any, source: str, skipped: Skipped) -> None:
    from rmm.cli.tables import Figures, print_figures

    pct = f"{100 * report.level:.0f}%"
    caption = ["reward: per shown memory (+1 cited, −1 not); cited: memories cited per retrieval",
               f"{report.selections:,} logged selections ({source}), {report.shown:,} memories shown; inclusion "
               f"probabilities {report.inclusion}"
               + (f" ({report.samples} races per selection, largest standard error {report.max_stderr:.2g})"
                  if report.samples else ""),
               f"{report.bootstrap} bootstrap resamples; clip {report.clip:g}; target mass outside the logging "
               f"policy's support {100 * report.unsupported:.2f}%"]
    clipped = report.get("ips-clipped").clipped
    caption.append(f"ESS out of {report.shown:,} shown memories (slate: of {report.selections:,} selections); "
                   f"ips-clipped capped {100 * clipped:.1f}% of the weights")
    if skipped:
        caption.append("skipped: " + ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())))
    table = Figures(f"rmm ope: {report.target}", ["estimator", "reward", f"{pct} CI", "cited", f"{pct} CI",
                                                  "ESS", "mean w", "max w"], caption="\n".join(caption))
    for e in report.estimates:
        table.add_row(e.name, f"{e.value:+.3f}", f"[{e.low:+.3f}, {e.high:+.3f}]", f"{e.cited:.3f}",
                      f"[{e.cited_low:.3f}, {e.cited_high:.3f}]", f"{e.ess:,.0f}", f"{e.mean_weight:.2f}",
                      f"{e.max_weight:.3g}")
    print_figures(table, console)
    for note in report.notes:
        console.print(f"note: {note}", highlight=False)


# ---- a running server's shadow ---------------------------------------------------------------------
def _fmt(value: float | None, sign: bool = True) -> str:
    return "–" if value is None else (f"{value:+.4f}" if sign else f"{value:,.1f}")


def _print_decision(d: Any) -> None:
    """The server's decision: the shadow's estimate and lower bound beside the live value."""
    from rich.markup import escape

    from rmm.cli.tables import Figures, print_figures

    pct = f"{100 * d.level:.0f}%"
    table = Figures(f"rmm ope --server: shadow {d.shadow} vs live ({d.key or 'bank'})",
                    ["estimator", "reward", f"{pct} CI", "ESS"],
                    caption=f"{d.selections:,} rewarded sampled selections of the live policy; live value "
                            f"{_fmt(d.live_value)} per shown memory; bar: {d.estimator} lower bound > live "
                            f"value + margin {d.margin:g}")
    for name, e in d.estimates.items():
        table.add_row(name + (" *" if name == d.estimator else ""), _fmt(e.get("value")),
                      f"[{_fmt(e.get('low'))}, {_fmt(e.get('high'))}]", _fmt(e.get("ess"), sign=False))
    if d.estimates:
        print_figures(table, console)
    console.print(escape(f"{d.status}: {d.reason}"), highlight=False, soft_wrap=True)


def run_server(args: argparse.Namespace) -> int:
    """`--server`: print the running estimate, or ask for promotion (module docstring for exit codes)."""
    from rich.markup import escape

    from rmm.serve.client import RmmClient, RmmServerError

    with RmmClient(args.server, args.api_key, timeout=args.timeout) as client:
        try:
            decision = client.promote() if args.promote else client.ope()
        except RmmServerError as exc:
            if exc.status == 409 and exc.code == "promotion_refused":
                console.print(escape(exc.message), highlight=False, soft_wrap=True)  # "promotion refused: why, both figures"
                return 1
            raise RmmError(exc.message if exc.status == 0 else f"{args.server}: {exc}") from exc
    _print_decision(decision)
    if args.promote:
        console.print(escape(f"promoted: the shadow's weights now serve {decision.key or 'the bank'}; the previous "
                             f"live weights are kept at {decision.previous}"), highlight=False, soft_wrap=True)
    write_json(args.json, {**decision.model_dump(), "server": args.server})
    return 0


def run(args: argparse.Namespace) -> int:
    from rmm.ope import EXACT_LIMIT, evaluate

    if args.server is not None:
        return run_server(args)
    rows, skipped, source = read_logs(args.logs, args.key, args.limit)
    if len(rows) < 2:
        why = f" (skipped: {dict(skipped)})" if skipped else ""
        raise RmmError(f"{args.logs} holds {len(rows)} usable rewarded, sampled selections; at least 2 needed{why}")
    target = load_target(args.target, rows, args.tau, args.greedy)
    report = evaluate(rows, target, clip=args.clip, bootstrap=args.bootstrap, level=args.level, folds=args.folds,
                      ridge=args.ridge, samples=args.samples,
                      exact_limit=EXACT_LIMIT if args.exact_limit is None else args.exact_limit, seed=args.seed,
                      min_ess=args.min_ess, max_unsupported=args.max_unsupported)
    _print(report, source, skipped)
    write_json(args.json, {**report.to_json(), "logs": args.logs, "source": source, "skipped": dict(skipped)})
    return 0
