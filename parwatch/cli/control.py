"""Operator commands against a running sidecar: status, pause, resume, rollback, cancel, decisions."""

from __future__ import annotations

import functools
import getpass
import json
from datetime import datetime, timezone
from pathlib import Path

import click

from parwatch import ledger_view
from parwatch.client import DEFAULT_ENDPOINT, SidecarClient, SidecarError
from parwatch.sidecar.config import TOKEN_FILE_NAME
from parwatch.tokens import TokenError, read_token
from parwatch.vocabulary import Action, DecisionSource, RecordType, SidecarRole
from parwatch.wire.findings import HangEvidence, bundle_of, finding_evidence

DEFAULT_TOKEN_FILE = Path("parwatch-state") / TOKEN_FILE_NAME
"""The token a `parwatch sidecar` started here with its default --state-dir generated."""

CTX = {"help_option_names": ["-h", "--help"]}


def _connection(f):
    @click.option(
        "--endpoint",
        envvar="PARWATCH_ENDPOINT",
        default=DEFAULT_ENDPOINT,
        show_default=True,
        help="The sidecar's control listener (env PARWATCH_ENDPOINT).",
    )
    @click.option(
        "--token-file",
        type=click.Path(dir_okay=False, exists=True),
        default=None,
        help=f"File with the bearer token (else env PARWATCH_TOKEN, else ./{DEFAULT_TOKEN_FILE} "
        "if there: what `parwatch sidecar` generates in its default --state-dir).",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print the raw JSON answer.")
    @functools.wraps(f)
    def wrapper(endpoint, token_file, as_json, **kw):
        try:
            token = read_token(token_file)
            if token is None and DEFAULT_TOKEN_FILE.is_file():
                token = read_token(DEFAULT_TOKEN_FILE)
            with SidecarClient(endpoint, token) as client:
                out = f(client, **kw)
        except TokenError as err:
            raise click.ClickException(str(err)) from None
        except SidecarError as err:
            raise click.ClickException(_with_fix(err, endpoint)) from None
        click.echo(json.dumps(out, indent=2) if as_json else _human(out))

    return wrapper


def _with_fix(err: SidecarError, endpoint: str) -> str:
    """The client's message, plus what to change on this command line."""
    if err.status is None:  # not an HTTP answer: the connection itself failed
        return (
            f"cannot reach the sidecar at {endpoint} ({err.__cause__ or err}); start `parwatch sidecar` there, "
            "or point --endpoint (env PARWATCH_ENDPOINT) at its --control-listen address"
        )
    if err.status == 401:
        return (
            f"{err}; pass the sidecar's token with --token-file FILE or the PARWATCH_TOKEN environment variable "
            "(a sidecar started without --token-file wrote one to STATE_DIR/token)"
        )
    return str(err)


def _human(out) -> str:
    if isinstance(out, dict) and "ranks" in out:
        return _status_text(out)
    if isinstance(out, list):
        return "\n".join(_decision_line(d) for d in out) or "no decisions yet"
    return _decision_line(out)


def _decision_line(d: dict) -> str:
    keys: tuple[str, ...]
    if d.get("type") not in (None, RecordType.DECISION):  # an outcome (applied, substituted, failed, ...) or a cancel
        keys = (
            "time",
            "step",
            "type",
            "action",
            "directive_id",
            "requested_step",
            "loaded_step",
            "ranks",
            "reasons",
            "requested_by",
            "note",
        )
    else:
        keys = ("time", "step", "rule", "action", "source", "reason", "to_step", "skip_batches", "directive_id")
        bundle = bundle_of(d)
        if bundle:  # where every reachable rank's stacks, last spans and activity are kept
            d = {**d, "evidence_in": f"STATE_DIR/{bundle}"}
            keys += ("evidence_in",)
    return "  ".join(f"{k}={d[k]}" for k in keys if d.get(k) not in (None, "", {})) or json.dumps(d)


def _status_text(s: dict) -> str:
    run = s.get("run") or {}
    lines = [
        f"run {run.get('run_id', '?')}  schedule={run.get('schedule', '?')} tp={run.get('tp', '?')} "
        f"pp={run.get('pp', '?')} dp={run.get('dp', '?')}  step={s.get('last_step')}  paused={s.get('paused')}",
    ]
    ranks = s.get("ranks", {})
    down = [r for r, v in ranks.items() if not v.get("up")]
    lines.append(f"ranks: {len(ranks)} reporting" + (f", down: {', '.join(down)}" if down else ""))
    lines += _link_lines(s.get("leader_link"))
    for r in s.get("refused") or ():
        lines.append(
            f"WARNING: refused {r['count']} {r['post']} posts ({r['reason']}), last at "
            f"{_when(r['last_time'])}: {r['detail']}"
        )
    if s.get("rules") is None and s.get("rules_judged_by"):  # a node sidecar: its engine judges nothing
        lines.append(f"rules: judged by the leader, {s['rules_judged_by']}")
    for name, st in sorted((s.get("rules") or {}).items()):
        lines.append(f"  rule {name}: {st.get('state')}")
    lines.append(_hang_line(s.get("hang")))
    if "time" in s:  # a sidecar older than the goodput ledger sends none
        lines.append(ledger_view.line(s["time"]))
    if s.get("pending_directive"):
        lines.append(f"pending directive: {json.dumps(s['pending_directive'])}")
    for d in s.get("last_decisions") or []:
        lines.append("  " + _decision_line(d))
    return "\n".join(lines)


def _when(t) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if t else "?"


def _link_lines(link: dict | None) -> list[str]:
    """A node sidecar's way to the leader (parwatch.sidecar.leader_link); nothing on a sidecar alone."""
    if not link or link.get("role") != SidecarRole.NODE:
        return []
    if link.get("reachable"):
        return [f"leader: {link.get('url')} (reachable)"]
    return [
        f"WARNING: leader {link.get('url') or '(no --leader-url)'} unreachable since "
        f"{_when(link.get('unreachable_since'))}: {link.get('error')}"
    ]


def _hang_line(h: dict | None) -> str:
    """One line from GET /v1/hang (parwatch.sidecar.activity_api): the culprit of a hang, if any."""
    if not h:
        return "hang: no activity data (sidecar without /v1/hang)"
    if not h.get("leader"):
        return f"hang: judged by the leader sidecar ({h.get('leader_url') or 'not configured: --leader-url'})"
    states = ", ".join(f"{n} {k}" for k, n in sorted((h.get("rank_states") or {}).items())) or "no ranks yet"
    record = h.get("hang")
    if not record:
        return f"hang: none (ranks: {states}; bound {h.get('bound_seconds', 0):.3g} s)"
    evidence = finding_evidence(record)
    if not isinstance(evidence, HangEvidence) or evidence.culprit is None:  # an unseen rank (or an older sidecar)
        return f"HANG: {record.get('reason', '').removeprefix('hang: ')} (ranks: {states})"
    c = evidence.culprit
    return (
        f"HANG{f' ({evidence.kind})' if evidence.kind else ''}: rank {c.rank} (stage {c.stage}, host {c.host}) in "
        f"{c.kind or 'between spans'}{' ' + c.op if c.op and c.op != c.kind else ''}; "
        f"{evidence.waiting_count} ranks wait for it (ranks: {states})"
        + (f"; evidence in STATE_DIR/{evidence.bundle}" if evidence.bundle else "")
    )


def _who() -> str:
    try:
        return f"operator:{getpass.getuser()}"
    except Exception:  # no user name in some containers
        return DecisionSource.OPERATOR


@click.command(context_settings=CTX, epilog="\b\nExample:\n  parwatch status --endpoint http://127.0.0.1:9401")
@_connection
def status(client):
    """Run, ranks (up/down), hang culprit, rule states, pending directive and recent decisions."""
    out = client.status()
    try:
        out["hang"] = client._call("GET", "/v1/hang")
    except SidecarError:  # an older sidecar: status without the hang line's data
        out["hang"] = None
    return out


@click.command(context_settings=CTX, epilog="\b\nExample:\n  parwatch pause --reason 'inspect the loss spike'")
@click.option("--reason", default="", help="Recorded with the decision.")
@_connection
def pause(client, reason):
    """Pause training at the next step boundary (every rank, same step)."""
    return client.control(Action.PAUSE, reason=reason, requested_by=_who())


@click.command(context_settings=CTX, epilog="\b\nExample:\n  parwatch resume --reason 'fixed the data shard'")
@click.option("--reason", default="", help="Recorded with the decision.")
@_connection
def resume(client, reason):
    """Resume a paused run."""
    return client.control(Action.RESUME, reason=reason, requested_by=_who())


@click.command(
    context_settings=CTX,
    epilog="\b\nExamples:\n  parwatch rollback\n  parwatch rollback --to-step 1200 --skip-batches 50",
)
@click.option(
    "--to-step",
    type=click.IntRange(min=0),
    default=None,
    help="Checkpoint step to load (default: the newest good one).",
)
@click.option(
    "--skip-batches",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Data batches to skip after loading.",
)
@click.option("--reason", default="", help="Recorded with the decision.")
@_connection
def rollback(client, to_step, skip_batches, reason):
    """Roll every rank back to a checkpoint at the next step boundary."""
    return client.control(
        Action.ROLLBACK, reason=reason, to_step=to_step, skip_batches=skip_batches, requested_by=_who()
    )


@click.command(context_settings=CTX, epilog="\b\nExample:\n  parwatch cancel 1764525600123")
@click.argument("directive_id", type=click.IntRange(min=1))
@_connection
def cancel(client, directive_id):
    """Withdraw a directive the run has not handled yet (its id: parwatch status)."""
    return client.cancel(directive_id, requested_by=_who())


@click.command(context_settings=CTX, epilog="\b\nExample:\n  parwatch decisions --limit 20 --json")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True)
@_connection
def decisions(client, limit):
    """Recent guardrail decisions, newest last."""
    return client.decisions(limit)
