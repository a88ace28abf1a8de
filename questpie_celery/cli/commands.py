"""The `questpie-celery` command line."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import datetime
from typing import Protocol, get_args

import click

from ..errors import QuestpieError
from ..intake import recorded_policy
from ..jobs.policies import QueuePolicy
from ..ledger import Ledger, Status, open_ledger
from ..ledger.schema import CanvasKind, CanvasStatus
from ..ops.operations import Operator
from ..ops.receipts import CanvasDetail, DispatchDetail
from ..publish.schedules import ScheduleInfo
from ..worker.retention import DEFAULT_RETENTION_SECONDS, Pruned, Retention
from .locating import load_questpie

#: What every `-A` says of what it takes.
APP_HELP = "your Questpie (module:attribute), or the app as celery -A takes it (-A proj)"


class _Admin(Protocol):
    """What the ledger commands need; a `Questpie` offers it, and a bare `Ledger` through
    `_LedgerAdmin`."""

    def migrate(self) -> int: ...
    def set_policy(self, job_name: str, policy: QueuePolicy, /) -> None: ...
    def get_policy(self, job_name: str, /) -> QueuePolicy | None: ...
    def close(self) -> None: ...


class _LedgerAdmin:
    """A bare `Ledger` as `_Admin`: its migration and its recorded policies."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def migrate(self) -> int:
        return self._ledger.migration.migrate()

    def set_policy(self, job_name: str, policy: QueuePolicy, /) -> None:
        self._ledger.policies.set(job_name, policy)

    def get_policy(self, job_name: str, /) -> QueuePolicy | None:
        return self._ledger.policies.get(job_name)

    def close(self) -> None:
        self._ledger.close()


#: Where `--pooled` is kept for the command's ledger (a context's meta is shared with
#: the contexts of its group).
_POOLED = "questpie_celery.pooled"


def _remember_pooled(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    ctx.meta[_POOLED] = value


def _pooled_option(function: Callable[..., None]) -> Callable[..., None]:
    """`--pooled` (or QUESTPIE_POOLED=1) for the ledger a `--ledger-url` opens."""
    return click.option(
        "--pooled",
        is_flag=True,
        envvar="QUESTPIE_POOLED",
        expose_value=False,
        callback=_remember_pooled,
        help="the --ledger-url reaches PostgreSQL through a pooler in transaction mode "
        "(PgBouncer); with --app, the app's Questpie(pooled=...) decides",
    )(function)


def _url_ledger(ledger_url: str) -> Ledger:
    pooled = bool(click.get_current_context().meta.get(_POOLED))
    return open_ledger(ledger_url, pooled=pooled)


def _admin(app: str | None, ledger_url: str | None) -> _Admin:
    if (app is None) == (ledger_url is None):
        raise click.UsageError("pass exactly one of --app and --ledger-url")
    admin: _Admin = (
        load_questpie(app) if app is not None else _LedgerAdmin(_url_ledger(str(ledger_url)))
    )
    # Close the pool when the command ends, not at interpreter exit.
    click.get_current_context().call_on_close(admin.close)
    return admin


@click.group()
def main() -> None:
    """Operate the questpie dispatch ledger of a Celery project."""


@main.command()
@click.option("-A", "--app", help=APP_HELP)
@click.option("--ledger-url", envvar="QUESTPIE_LEDGER_URL", help="SQLAlchemy URL of the ledger")
@_pooled_option
def migrate(app: str | None, ledger_url: str | None) -> None:
    """Create or upgrade the ledger schema (safe to run again)."""
    try:
        version = _admin(app, ledger_url).migrate()
    except QuestpieError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"ledger schema at version {version}")


@main.group()
def policy() -> None:
    """Show or change the queue policy recorded for a job."""


@policy.command("set")
@click.argument("job_name")
@click.argument("policy_name", metavar="POLICY", type=click.Choice([str(p) for p in QueuePolicy]))
@click.option("-A", "--app", help=APP_HELP)
@click.option("--ledger-url", envvar="QUESTPIE_LEDGER_URL", help="SQLAlchemy URL of the ledger")
@_pooled_option
@click.option(
    "--no-wait", is_flag=True, help="return at once; every process follows within the wait"
)
def policy_set(
    job_name: str, policy_name: str, app: str | None, ledger_url: str | None, no_wait: bool
) -> None:
    """Record POLICY for JOB_NAME; dispatches accepted from now on follow it.

    Returns once every worker and publisher holds to it: each caches a job's policy for
    a few seconds, so the command waits that long (unless --no-wait)."""
    try:
        _admin(app, ledger_url).set_policy(job_name, QueuePolicy(policy_name))
    except QuestpieError as exc:
        raise click.ClickException(str(exc)) from exc
    settle = recorded_policy.POLICY_SETTLE_SECONDS
    if no_wait:
        click.echo(f"{job_name}: {policy_name} (every process holds to it within {settle:.0f} s)")
        return
    click.echo(f"{job_name}: {policy_name} recorded; waiting {settle:.0f} s for cached copies")
    time.sleep(settle)
    click.echo(f"{job_name}: {policy_name} (in force at every worker and publisher)")


@policy.command("show")
@click.argument("job_name")
@click.option("-A", "--app", help=APP_HELP)
@click.option("--ledger-url", envvar="QUESTPIE_LEDGER_URL", help="SQLAlchemy URL of the ledger")
@_pooled_option
def policy_show(job_name: str, app: str | None, ledger_url: str | None) -> None:
    """Print the policy recorded for JOB_NAME (standard when none is)."""
    try:
        recorded = _admin(app, ledger_url).get_policy(job_name)
    except QuestpieError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{job_name}: {recorded or 'standard (none recorded)'}")


@main.command()
@click.option("-A", "--app", required=True, help=APP_HELP)
@click.option("--once", is_flag=True, help="make one pass and exit")
@click.option(
    "--end-lapsed-leases",
    is_flag=True,
    help="with --once: also end lapsed leases now (only when their workers are gone)",
)
def relay(app: str, once: bool, end_lapsed_leases: bool) -> None:
    """Run the relay in the foreground (workers also run it in the background)."""
    questpie = load_questpie(app)
    if once:
        moved = questpie.run_relay(once=True, end_lapsed_leases=end_lapsed_leases)
        click.echo(f"moved {moved} dispatch(es)")
        return
    _log_with_times()
    stop = threading.Event()
    click.echo(f"relay running every {questpie.relay_interval}s; Ctrl-C stops it")
    try:
        questpie.run_relay(stop=stop)
    except KeyboardInterrupt:
        stop.set()


def _operator(app: str | None, ledger_url: str | None) -> Operator:
    if (app is None) == (ledger_url is None):
        raise click.UsageError("pass exactly one of --app and --ledger-url")
    if app is not None:
        questpie = load_questpie(app)
        click.get_current_context().call_on_close(questpie.close)
        return questpie.operator
    ledger = _url_ledger(str(ledger_url))
    click.get_current_context().call_on_close(ledger.close)
    return Operator(ledger)


def _target(function: Callable[..., None]) -> Callable[..., None]:
    """The options every `dispatches` command takes."""
    function = click.option("--json", "as_json", is_flag=True, help="print JSON")(function)
    function = _pooled_option(function)
    function = click.option(
        "--ledger-url", envvar="QUESTPIE_LEDGER_URL", help="SQLAlchemy URL of the ledger"
    )(function)
    return click.option("-A", "--app", help=APP_HELP)(function)


def _print(details: list[DispatchDetail], as_json: bool, reasons: list[str] | None = None) -> None:
    if as_json:
        rows = [d.to_json() for d in details]
        if reasons is not None:
            rows = [{"reason": r, **row} for r, row in zip(reasons, rows, strict=True)]
        click.echo(json.dumps(rows, indent=2))
        return
    for n, d in enumerate(details):
        reason = f"{reasons[n]:<24} " if reasons is not None else ""
        click.echo(
            f"{reason}{d.dispatch_id}  {d.job_name:<24} {d.status:<9} attempt={d.attempt} "
            f"key={d.idempotency_key or '-'} error={d.last_error or '-'} "
            f"created={d.created_at:%Y-%m-%d %H:%M:%S}"
        )
    if not details:
        click.echo("(none)")


@main.group()
def dispatches() -> None:
    """See and steer the ledger's dispatches (never shows a secret payload)."""


@dispatches.command("list")
@_target
@click.option("--job", help="only this job")
@click.option("--status", type=click.Choice(list(get_args(Status))), help="only this status")
@click.option("--key", help="only this idempotency key")
@click.option("--older-than", type=float, help="only dispatches created this many seconds ago")
@click.option("--limit", type=int, default=50, show_default=True)
def dispatches_list(
    app: str | None, ledger_url: str | None, as_json: bool, job: str | None,
    status: str | None, key: str | None, older_than: float | None, limit: int,
) -> None:  # fmt: skip
    """List dispatches, newest first."""
    with _clear_errors():
        found = _operator(app, ledger_url).dispatches(
            job=job, status=status, key=key, older_than=older_than, limit=limit
        )
    _print(found, as_json)


@dispatches.command("show")
@_target
@click.argument("dispatch_id")
def dispatches_show(
    app: str | None, ledger_url: str | None, as_json: bool, dispatch_id: str
) -> None:
    """Everything about one dispatch."""
    with _clear_errors():
        detail = _operator(app, ledger_url).show(dispatch_id)
    if detail is None:
        raise click.ClickException(f"no ledgered dispatch has the id {dispatch_id}")
    if as_json:
        click.echo(json.dumps(detail.to_json(), indent=2))
        return
    shown = detail.to_json()
    # A member of a chord or batch names it: `canvases show` tells where that stands.
    shown["chord/batch"] = shown.pop("canvas_id") or "-"
    for name, value in shown.items():
        click.echo(f"{name:>18}: {value}")


@dispatches.command("stuck")
@_target
@click.option("--limit", type=int, default=100, show_default=True)
def dispatches_stuck(app: str | None, ledger_url: str | None, as_json: bool, limit: int) -> None:
    """What should have moved on and did not, and why."""
    with _clear_errors():
        found = _operator(app, ledger_url).stuck(limit=limit)
    _print([d for _, d in found], as_json, [r for r, _ in found])


@dispatches.command("failed")
@_target
@click.option("--job", help="only this job")
@click.option("--limit", type=int, default=50, show_default=True)
def dispatches_failed(
    app: str | None, ledger_url: str | None, as_json: bool, job: str | None, limit: int
) -> None:
    """Failed dispatches, newest first, with their error class."""
    with _clear_errors():
        found = _operator(app, ledger_url).failed(limit=limit, job=job)
    _print(found, as_json)


@dispatches.command("requeue")
@_target
@click.argument("dispatch_id")
def dispatches_requeue(
    app: str | None, ledger_url: str | None, as_json: bool, dispatch_id: str
) -> None:
    """Send a failed dispatch again: a new attempt under the same id and key."""
    with _clear_errors():
        detail = _operator(app, ledger_url).requeue(dispatch_id)
    _print([detail], as_json)


@dispatches.command("cancel")
@_target
@click.argument("dispatch_id")
def dispatches_cancel(
    app: str | None, ledger_url: str | None, as_json: bool, dispatch_id: str
) -> None:
    """Cancel a dispatch for every worker: one not started never runs; one running goes
    on, is not retried, and ends as cancelled. Exits 1 when it had ended already."""
    with _clear_errors():
        cancelled, detail = _operator(app, ledger_url).cancel(dispatch_id)
    _print([detail], as_json)
    if not cancelled:
        click.echo(
            f"dispatch {dispatch_id} had already ended ({detail.status}); nothing changed", err=True
        )
        raise SystemExit(1)


@dispatches.command("groups")
@_target
@click.option("--limit", type=int, default=100, show_default=True)
def dispatches_groups(app: str | None, ledger_url: str | None, as_json: bool, limit: int) -> None:
    """The groups of jobs with a concurrency or rate limit: running, waiting, and why."""
    with _clear_errors():
        groups = _operator(app, ledger_url).groups(limit=limit)
    if as_json:
        click.echo(json.dumps([asdict(g) for g in groups], indent=2))
        return
    for g in groups:
        click.echo(
            f"{g.job_name:<28} {g.group_key or '(whole job)':<24} running={g.running} "
            f"waiting: concurrency={g.waiting_for_concurrency} rate={g.waiting_for_rate} "
            f"on their way={g.on_their_way}"
        )
    if not groups:
        click.echo("(no group holds a seat or waits)")


@dispatches.command("counts")
@_target
def dispatches_counts(app: str | None, ledger_url: str | None, as_json: bool) -> None:
    """How many dispatches each job has in each status, and the oldest one's age."""
    with _clear_errors():
        counts = _operator(app, ledger_url).counts()
    if as_json:
        click.echo(json.dumps([asdict(c) for c in counts], indent=2))
        return
    for c in counts:
        click.echo(
            f"{c.job_name:<28} {c.status:<9} {c.count:>8}   oldest {c.oldest_age_seconds:,.0f}s"
        )
    if not counts:
        click.echo("(the ledger is empty)")


def _counts_text(counts: dict[str, int]) -> str:
    return " ".join(f"{status}={n}" for status, n in sorted(counts.items())) or "-"


def _canvas_line(c: CanvasDetail) -> str:
    callback = f"{c.callback_id} ({c.callback_status or 'not sent'})" if c.callback_id else "-"
    failed = f" failed_member={c.failed_member}" if c.failed_member else ""
    return (
        f"{c.canvas_id}  {c.kind:<5} {c.status:<9} members={c.members} "
        f"[{_counts_text(c.counts)}] callback={callback}{failed} "
        f"created={c.created_at:%Y-%m-%d %H:%M:%S}"
    )


@main.group()
def canvases() -> None:
    """See the ledger's chords and batches: their members by status and their callback's
    dispatch (never a callback's contents, nor a result)."""


@canvases.command("list")
@_target
@click.option("--status", type=click.Choice(list(get_args(CanvasStatus))), help="only this status")
@click.option(
    "--kind", type=click.Choice(list(get_args(CanvasKind))), help="only chords or batches"
)
@click.option("--limit", type=int, default=50, show_default=True)
def canvases_list(
    app: str | None, ledger_url: str | None, as_json: bool, status: str | None,
    kind: str | None, limit: int,
) -> None:  # fmt: skip
    """List chords and batches, newest first, with their members by status."""
    with _clear_errors():
        found = _operator(app, ledger_url).canvases(limit=limit, status=status, kind=kind)
    if as_json:
        click.echo(json.dumps([c.to_json() for c in found], indent=2))
        return
    for c in found:
        click.echo(_canvas_line(c))
    if not found:
        click.echo("(none)")


@canvases.command("show")
@_target
@click.option("--members", "with_members", is_flag=True, help="also list each member")
@click.argument("canvas_id")
def canvases_show(
    app: str | None, ledger_url: str | None, as_json: bool, with_members: bool, canvas_id: str
) -> None:
    """One chord or batch (by its id, or its callback's dispatch id): status, members by
    status, callback's dispatch, the member that failed it."""
    with _clear_errors():
        operator = _operator(app, ledger_url)
        detail = operator.canvas(canvas_id)
        members = operator.canvas_members(detail.canvas_id) if detail and with_members else None
    if detail is None:
        raise click.ClickException(f"no chord or batch has the id {canvas_id}")
    if as_json:
        shown = detail.to_json()
        if members is not None:
            shown["member_list"] = [asdict(m) for m in members]
        click.echo(json.dumps(shown, indent=2))
        return
    lines = detail.to_json()
    lines["counts"] = _counts_text(detail.counts)
    lines["callback_status"] = detail.callback_status or ("not sent" if detail.callback_id else "-")
    for name, value in lines.items():
        click.echo(f"{name:>18}: {value}")
    for m in members or ():
        click.echo(
            f"  #{m.position:<5} {m.dispatch_id or '-'}  {m.job_name or '-':<24} "
            f"{m.status:<9} error={m.last_error or '-'}"
        )


@main.command()
@_target
def schedules(app: str | None, ledger_url: str | None, as_json: bool) -> None:
    """Every schedule: job, cron, zone, next fire, last fire and its dispatch's status."""
    with _clear_errors():
        found = _operator(app, ledger_url).schedules()
    if as_json:
        click.echo(json.dumps([_schedule_json(s) for s in found], indent=2))
        return
    for s in found:
        last = (
            f"{s.last_fire_at:%Y-%m-%d %H:%M} UTC -> {s.last_status or 'suppressed or pruned'}"
            if s.last_fire_at
            else "never fired"
        )
        click.echo(
            f"{s.job_name:<28} {s.source:<6} {s.cron:<16} {s.tz:<18} "
            f"next {s.next_fire_at:%Y-%m-%d %H:%M} UTC   last {last}"
        )
    if not found:
        click.echo("(no schedules)")


@main.command()
@click.argument("job_name")
@click.option("-A", "--app", help=APP_HELP)
@click.option("--ledger-url", envvar="QUESTPIE_LEDGER_URL", help="SQLAlchemy URL of the ledger")
@_pooled_option
def unschedule(job_name: str, app: str | None, ledger_url: str | None) -> None:
    """Remove every schedule of JOB_NAME, also of a job deleted from the code (an
    options.cron schedule of a job still declared comes back when a worker starts)."""
    with _clear_errors():
        removed = _operator(app, ledger_url).unschedule(job_name)
    click.echo(f"{job_name}: {removed} schedule(s) removed")


@main.command()
@click.option("-A", "--app", help=APP_HELP)
@click.option("--ledger-url", envvar="QUESTPIE_LEDGER_URL", help="SQLAlchemy URL of the ledger")
@_pooled_option
@click.option(
    "--older-than",
    type=click.FloatRange(min=0),
    help="seconds since a dispatch ended (default: the app's retention, or 7 days)",
)
def prune(app: str | None, ledger_url: str | None, older_than: float | None) -> None:
    """Apply retention now: delete ended unkeyed dispatches and drop the payload and
    options of ended keyed ones (their key keeps its id). Dispatches that have not ended,
    and schedule fires (the beat's), are left alone; an unkeyed one stays until the app's
    redeliver_after (with --ledger-url, an hour) has passed since it ended."""
    if (app is None) == (ledger_url is None):
        raise click.UsageError("pass exactly one of --app and --ledger-url")
    with _clear_errors():
        if app is not None:
            questpie = load_questpie(app)
            click.get_current_context().call_on_close(questpie.close)
            period = older_than if older_than is not None else questpie.retention
            if period is None:
                raise click.UsageError(
                    "this app keeps ended dispatches for ever (retention=None); "
                    "pass --older-than to prune anyway"
                )
            result = questpie.prune(period)
        else:
            ledger = _url_ledger(str(ledger_url))
            click.get_current_context().call_on_close(ledger.close)
            period = older_than if older_than is not None else DEFAULT_RETENTION_SECONDS
            result = Retention(ledger, period).prune(period)
    click.echo(_pruned_line(result, period))


def _pruned_line(result: Pruned, period: float) -> str:
    return (
        f"deleted {result.deleted} ended unkeyed dispatch(es) and pruned {result.pruned} "
        f"ended keyed one(s) (payload and options dropped) that ended over {period:g} s ago"
    )


def _schedule_json(info: ScheduleInfo) -> dict[str, object]:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in asdict(info).items()}


@main.command()
@click.option("-A", "--app", help=APP_HELP)
@click.option("--ledger-url", envvar="QUESTPIE_LEDGER_URL", help="SQLAlchemy URL of the ledger")
@_pooled_option
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=int, default=8700, show_default=True)
@click.option(
    "--public",
    is_flag=True,
    help="allow an address other than this machine's loopback; the page has no login, "
    "so put it behind one",
)
@click.option("--refresh", type=click.IntRange(2, 3600), default=10, show_default=True)
def web(
    app: str | None, ledger_url: str | None, host: str, port: int, public: bool, refresh: int
) -> None:
    """Serve the read-only status page (needs `pip install 'questpie-celery[web]'`)."""
    try:
        from .. import web as status_page  # noqa: PLC0415  (an optional extra)
    except ImportError as exc:
        raise click.ClickException(
            f"the status page needs the web extra ({exc.name} is missing): "
            "pip install 'questpie-celery[web]'"
        ) from exc
    if not status_page.is_loopback(host) and not public:
        raise click.UsageError(
            f"--host {host} would serve the page beyond this machine, and it has no login; "
            "pass --public to do that on purpose"
        )
    with _clear_errors():
        operator = _operator(app, ledger_url)
    label = operator.ledger_label
    _log_with_times()
    click.echo(f"status page of {label} on http://{host}:{port}/ (Ctrl-C stops it)")
    status_page.serve(
        status_page.status_app(operator, ledger=label, refresh_seconds=refresh, public=public),
        host=host,
        port=port,
    )


def _log_with_times() -> None:
    """For the commands that run until stopped: warnings (an outage, its end) on stderr
    with their time, unless the program configured logging itself."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )


@contextlib.contextmanager
def _clear_errors() -> Iterator[None]:
    try:
        yield
    except QuestpieError as exc:
        raise click.ClickException(str(exc)) from exc
