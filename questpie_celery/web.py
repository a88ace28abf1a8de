"""The status page: `questpie-celery web`, the ledger at a glance, read-only.

One page (and the same data as JSON at `/overview.json`): dispatches per job and
status, what is stuck and why, what failed, parked runs per queue-policy slot, the
groups of jobs with concurrency or rate limits (running, waiting and why), the newest
chords and batches (members by status, the callback's dispatch), and
the relay's backlog over the last hour; and `/metrics`, the figures for Prometheus
(`ops/metrics.py`). It only reads, so it offers nothing to steer with;
`questpie-celery dispatches requeue` does that.

It needs the `web` extra (Starlette, uvicorn, Jinja2, prometheus_client). Every query
behind it is an index range scan or one grouped count, so it stays quick on a large
ledger.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar, get_args

import anyio
import jinja2
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ._runtime.outages import Outage
from .errors import LedgerUnavailableError, QuestpieError
from .ledger import Status
from .ledger.schema import WAITING
from .ops.metrics import Figures, LedgerCollector, read_figures
from .ops.operations import Operator, Overview
from .ops.receipts import CanvasDetail, DispatchDetail

log = logging.getLogger(__name__)
T = TypeVar("T")

STATUSES: tuple[str, ...] = get_args(Status)
PLOT_SECONDS = 3600
PLOT_WIDTH, PLOT_HEIGHT = 720, 160
#: A read that takes longer gets a 503 (a stalled database must not hang the page).
READ_TIMEOUT_SECONDS = 15.0

_templates = jinja2.Environment(
    loader=jinja2.PackageLoader("questpie_celery", "templates"),
    # Job names, keys and error classes come from users: escape everything.
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (the page's default; anything else must be
    asked for explicitly). A name counts when every address it resolves to is loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        found = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in found)


@dataclass(frozen=True)
class JobRow:
    job_name: str
    counts: dict[str, int]
    oldest_waiting_seconds: float | None


@dataclass(frozen=True)
class Plot:
    """The backlog plot, laid out: an SVG polyline, its newest point and axis labels."""

    points: str
    last: tuple[float, float] | None  # where the newest sample sits, marked with a dot
    y_max: int
    latest: int | None
    x_labels: list[tuple[float, str]]  # (x, label)


def job_rows(overview: Overview) -> list[JobRow]:
    """The counts pivoted to one row per job, a column per status."""
    rows: dict[str, dict[str, int]] = {}
    oldest: dict[str, float] = {}
    for c in overview.counts:
        rows.setdefault(c.job_name, {})[c.status] = c.count
        if c.status in WAITING and c.oldest_due_seconds is not None:
            oldest[c.job_name] = max(oldest.get(c.job_name, 0.0), c.oldest_due_seconds)
    return [JobRow(job, rows[job], oldest.get(job)) for job in sorted(rows)]


def backlog_plot(samples: list[tuple[datetime, int]], now: datetime) -> Plot:
    """Place each sample of the last hour on the plot: time left to right, count upward."""
    start = now - timedelta(seconds=PLOT_SECONDS)
    recent = [(at, n) for at, n in samples if start <= at <= now]
    y_max = _nice_ceiling(max((n for _, n in recent), default=0))
    xy = [
        (
            round((at - start).total_seconds() / PLOT_SECONDS * PLOT_WIDTH, 1),
            round(PLOT_HEIGHT - n / y_max * PLOT_HEIGHT, 1),
        )
        for at, n in recent
    ]
    x_labels = [(PLOT_WIDTH * i / 4, f"-{60 - 15 * i} min" if i < 4 else "now") for i in range(5)]
    return Plot(
        points=" ".join(f"{x},{y}" for x, y in xy),
        last=xy[-1] if xy else None,
        y_max=y_max,
        latest=recent[-1][1] if recent else None,
        x_labels=x_labels,
    )


def _nice_ceiling(value: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that is at least `value` (and >= 5)."""
    ceiling = 1
    while True:
        for step in (1, 2, 5):
            if ceiling * step >= max(value, 5):
                return ceiling * step
        ceiling *= 10


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


def render(overview: Overview, *, ledger: str, refresh_seconds: int) -> str:
    return _templates.get_template("status.html").render(
        overview=overview,
        jobs=job_rows(overview),
        statuses=STATUSES,
        plot=backlog_plot(overview.backlog, overview.taken_at),
        plot_width=PLOT_WIDTH,
        plot_height=PLOT_HEIGHT,
        ledger=ledger,
        refresh_seconds=refresh_seconds,
        age=age,
    )


def _dispatch(d: DispatchDetail) -> dict[str, Any]:
    """What the page tells of one dispatch: never its payload or its keys, which may name
    people or orders, on a page without a login."""
    return {
        "dispatch_id": d.dispatch_id,
        "job_name": d.job_name,
        "status": d.status,
        "attempt": d.attempt,
        "last_error": d.last_error,
        "secret": d.secret,
        "created_at": d.created_at.isoformat(),
        "finished_at": d.finished_at.isoformat() if d.finished_at else None,
    }


def _canvas(c: CanvasDetail) -> dict[str, Any]:
    """What the page tells of a chord or batch: never its callback's or errbacks'
    signatures (their arguments may name people or orders), nor a member's result."""
    return {
        "canvas_id": c.canvas_id,
        "kind": c.kind,
        "status": c.status,
        "on_member_failure": c.on_member_failure,
        "members": c.members,
        "counts": c.counts,
        "callback_id": c.callback_id,
        "callback_status": c.callback_status,
        "failed_member": c.failed_member,
        "created_at": c.created_at.isoformat(),
        "finished_at": c.finished_at.isoformat() if c.finished_at else None,
    }


def overview_json(overview: Overview) -> dict[str, Any]:
    return {
        "taken_at": overview.taken_at.isoformat(),
        "missing": overview.missing,
        "counts": [
            {
                "job_name": j.job_name,
                "counts": j.counts,
                "oldest_waiting_seconds": j.oldest_waiting_seconds,
            }
            for j in job_rows(overview)
        ],
        "stuck": [{"reason": reason, **_dispatch(d)} for reason, d in overview.stuck],
        "failed": [_dispatch(d) for d in overview.failed],
        "parked": [
            {
                "job_name": p.job_name,
                "slot": p.slot,
                "count": p.count,
                "oldest_age_seconds": p.oldest_age_seconds,
            }
            for p in overview.parked
        ],
        "groups": [asdict(g) for g in overview.groups],
        "canvases": [_canvas(c) for c in overview.canvases],
        "schedules": [
            {
                "job_name": sc.job_name,
                "source": sc.source,
                "cron": sc.cron,
                "tz": sc.tz,
                "next_fire_at": sc.next_fire_at.isoformat(),
                "last_fire_at": sc.last_fire_at.isoformat() if sc.last_fire_at else None,
                "last_status": sc.last_status,
            }
            for sc in overview.schedules
        ],
        "backlog": [{"sampled_at": at.isoformat(), "due": n} for at, n in overview.backlog],
    }


def status_app(
    operator: Operator, *, ledger: str, refresh_seconds: int = 10, public: bool = False
) -> Starlette:
    """The page as an ASGI application; `ledger` names the ledger in its header.

    Unless `public`, it answers only requests addressed to this machine by name
    (`localhost`, `127.0.0.1`, `[::1]`), so a web page elsewhere cannot read it through a
    hostname that resolves to 127.0.0.1 (DNS rebinding).
    """

    # Every browser refreshing the page while the ledger is down would otherwise say so
    # on each request: the log hears of the outage once, then each minute, then its end.
    # A ledger that answers but cannot be read (not migrated, say) is not an outage.
    outage = Outage("the dispatch ledger", logger=log)
    unreadable = Outage(
        "the dispatch ledger", trouble="cannot be read", recovered="can be read again", logger=log
    )

    async def read(what: Callable[[], T]) -> T:
        try:
            with anyio.fail_after(READ_TIMEOUT_SECONDS):
                found = await run_in_threadpool(what)
        except (LedgerUnavailableError, TimeoutError) as exc:
            outage.failed(_unavailable(exc))
            raise
        except QuestpieError as exc:
            unreadable.failed(exc)
            raise
        outage.reached()
        unreadable.reached()
        return found

    async def page(request: Request) -> Response:
        try:
            overview = await read(operator.overview)
        except (QuestpieError, TimeoutError) as exc:
            # The ledger is down or stalled: say so, and keep refreshing until it is back.
            body = _templates.get_template("unavailable.html").render(
                ledger=ledger, error=_unavailable(exc), refresh_seconds=refresh_seconds
            )
            return HTMLResponse(body, status_code=503)
        return HTMLResponse(render(overview, ledger=ledger, refresh_seconds=refresh_seconds))

    async def as_json(request: Request) -> Response:
        try:
            overview = await read(operator.overview)
        except (QuestpieError, TimeoutError) as exc:
            return JSONResponse({"error": _unavailable(exc)}, status_code=503)
        return JSONResponse(overview_json(overview))

    # The page's own registry, not prometheus_client's global one: only the ledger's
    # figures, whatever else the process (an app mounting this one) registers there.
    # The collector reads the figures this request read: a scrape reads the ledger once,
    # off the event loop, under the page's timeout, and concurrent scrapes keep theirs.
    scraped: ContextVar[Figures | None] = ContextVar("scraped")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector(scraped.get))

    async def metrics(request: Request) -> Response:
        try:
            figures: Figures | None = await read(lambda: read_figures(operator))
        except (QuestpieError, TimeoutError):
            # Answered, not refused: Prometheus's own `up` then still tells a page that is
            # down from a ledger that is, which `questpie_ledger_up` tells.
            figures = None
        scraped.set(figures)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    middleware = (
        []
        if public
        else [Middleware(TrustedHostMiddleware, allowed_hosts=["localhost", "127.0.0.1", "[::1]"])]
    )
    return Starlette(
        routes=[Route("/", page), Route("/overview.json", as_json), Route("/metrics", metrics)],
        middleware=middleware,
    )


def _unavailable(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"the ledger did not answer within {READ_TIMEOUT_SECONDS:.0f} s"
    return str(exc)


def serve(app: Starlette, *, host: str, port: int) -> None:
    """Serve the page until interrupted."""
    import uvicorn  # noqa: PLC0415  (only the serving command needs it)

    uvicorn.run(app, host=host, port=port, log_level="warning")
