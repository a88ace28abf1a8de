"""Everything that crosses the broker: the message header, priorities, and sending.

A questpie message is an ordinary Celery task message: the task named after the
job, one positional argument (the payload as a JSON object), the task's serializer
(JSON for a job's; an adopted Celery task's payload is its serialized call, sent with
the serializer the app accepts).
Our metadata rides in one custom header, `questpie`, which Celery exposes as
`task.request.questpie` and copies into the message of a `retry()`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from celery import Celery, Task

from .._runtime import telemetry
from ..errors import BrokerError, MalformedHeaderError, PublishOptionsError
from ..filesystem import TRANSPORT as FILESYSTEM_TRANSPORT
from ..jobs.options import MAX_PRIORITY, QUESTPIE_HEADER, RunOptions

log = logging.getLogger(__name__)

HEADER = QUESTPIE_HEADER
HEADER_VERSION = 1
#: Extra seconds between the soft and the hard time limit of a run.
HARD_TIME_LIMIT_GRACE_SECONDS = 30
#: How hard a publish tries the broker before it gives up (a ledgered dispatch then
#: stays pending for the relay). Kept short so publish() answers within seconds.
PUBLISH_RETRY_POLICY: Mapping[str, Any] = {
    "max_retries": 2,
    "interval_start": 0,
    "interval_step": 0.5,
    "interval_max": 1,
}
_REDIS_SCHEMES = ("redis", "rediss", "sentinel", "redis+socket")
_AMQP_SCHEMES = ("amqp", "amqps", "pyamqp", "librabbitmq")


@dataclass(frozen=True)
class MessageHeader:
    """The `questpie` header of one message."""

    ledgered: bool
    attempt: int = 1
    """Which claim this delivery is meant to take (1 for the first run)."""
    run: RunOptions = field(default_factory=RunOptions)
    token: str | None = None
    """The fencing token of an earlier try of this very delivery, sent back to the broker
    while the ledger was unreachable: its claim may have landed unseen."""
    sent_at: float | None = None
    """When the message was sent (Unix time, the sender's clock)."""

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "v": HEADER_VERSION,
            "ledgered": self.ledgered,
            "attempt": self.attempt,
            "run": self.run.to_dict(),
        }
        if self.token is not None:
            data["token"] = self.token
        if self.sent_at is not None:
            data["sent"] = self.sent_at
        return data

    @classmethod
    def from_request(cls, request: Any) -> MessageHeader | None:
        """Read the header from a task request; None for a plain Celery call.

        Raises `MalformedHeaderError` for a header questpie could not have written."""
        raw = getattr(request, HEADER, None)
        if raw is None:
            raw = (getattr(request, "headers", None) or {}).get(HEADER)
        return None if raw is None else cls.parse(raw)

    @classmethod
    def parse(cls, raw: object) -> MessageHeader:
        """The header `to_dict` wrote, read back; `MalformedHeaderError` (saying which
        field, never its value) for anything else. Fields it does not know are left
        alone, so a newer sender's additions do not stop an older worker."""
        if not isinstance(raw, Mapping):
            raise MalformedHeaderError(f"it is a {type(raw).__name__}, not a mapping")
        version = raw.get("v")
        if type(version) is not int or version != HEADER_VERSION:
            raise MalformedHeaderError(f"its version `v` is not {HEADER_VERSION}")
        ledgered = raw.get("ledgered")
        if not isinstance(ledgered, bool):
            raise MalformedHeaderError("`ledgered` is not a bool")
        attempt = raw.get("attempt")
        if type(attempt) is not int or not 1 <= attempt <= MAX_ATTEMPT:
            raise MalformedHeaderError(f"`attempt` is not an int from 1 to {MAX_ATTEMPT}")
        try:
            run = RunOptions.parse(raw.get("run"))
        except PublishOptionsError as exc:
            raise MalformedHeaderError(f"`run` does not parse: {exc}") from None
        token = raw.get("token")
        if token is not None and not _is_token(token):
            raise MalformedHeaderError("`token` is not a UUID")
        sent = raw.get("sent")
        # (A comparison, not math.isfinite: NaN fails it, and a huge int cannot overflow.)
        if sent is not None and not (type(sent) in (int, float) and 0 < sent < MAX_SENT_AT):
            raise MalformedHeaderError("`sent` is not a Unix time")
        return cls(
            ledgered=ledgered,
            attempt=attempt,
            run=run,
            token=token,
            sent_at=None if sent is None else float(sent),
        )


#: The most claims a header may name: the ledger counts attempts in a 32-bit integer.
MAX_ATTEMPT = 2**31 - 1
#: Later than any `sent` stamp (the year 2286): a float that far is not a time.
MAX_SENT_AT = 1e10


def _is_token(value: object) -> bool:
    """A fencing token as the fence writes them: a UUID in its canonical text form."""
    if not isinstance(value, str) or len(value) != 36:
        return False
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


def _schemes(url: object) -> list[str]:
    """The transport schemes of a broker URL as Celery takes one (a string, failover URLs
    joined by `;`, or a list of them), in the order they are tried."""
    urls = url if isinstance(url, (list, tuple)) else [url]
    return [
        alternate.split("://", 1)[0].strip().lower()
        for one in urls
        for alternate in str(one).split(";")
    ]


def broker_kind(app: Celery) -> str:
    """`redis`, `amqp`, or the transport scheme of anything else."""
    scheme = _schemes(app.conf.broker_url or app.conf.broker_write_url or "amqp://")[0]
    if scheme in _REDIS_SCHEMES:
        return "redis"
    if scheme in _AMQP_SCHEMES:
        return "amqp"
    return scheme


def broker_priority(kind: str, priority: int | None) -> int | None:
    """Map our priority (0-9, higher first) to what the broker serves first.

    Redis (kombu) serves the lowest number first; RabbitMQ the highest.
    """
    if priority is None:
        return None
    return MAX_PRIORITY - priority if kind == "redis" else priority


#: Without it, publishing to an unreachable Redis host waits for the OS's TCP timeout.
REDIS_SOCKET_CONNECT_TIMEOUT_SECONDS = 5


def configure_app(app: Celery) -> None:
    """Configure what questpie needs on a configured Celery app, keeping the user's choices."""
    kind = broker_kind(app)
    # kombu's own filesystem transport loses a message a worker reads while it is written
    # (see the module). The setting applies to every URL the app connects to, so only an
    # app that reaches nothing but the filesystem gets it; and it is taken back when the
    # broker changes (tests swap it), since it is ours and not the app's choice.
    urls = [app.conf.broker_url, app.conf.broker_read_url, app.conf.broker_write_url]
    only_files = all(scheme == "filesystem" for url in urls if url for scheme in _schemes(url))
    if kind == "filesystem" and only_files and not app.conf.broker_transport:
        app.conf.broker_transport = FILESYSTEM_TRANSPORT
    elif app.conf.broker_transport == FILESYSTEM_TRANSPORT and not only_files:
        app.conf.broker_transport = None
    if kind != "redis":
        return
    options = dict(app.conf.broker_transport_options or {})
    options.setdefault("socket_connect_timeout", REDIS_SOCKET_CONNECT_TIMEOUT_SECONDS)
    wanted = {"priority_steps": list(range(MAX_PRIORITY + 1)), "queue_order_strategy": "priority"}
    for name, value in wanted.items():
        if name not in options:
            options[name] = value
        elif options[name] != value:
            log.warning(
                "broker_transport_options[%r] is %r; questpie priorities need %r, "
                "so priorities may not order as documented",
                name,
                options[name],
                value,
            )
    app.conf.broker_transport_options = options


LEDGER_SCHEDULER = "questpie_celery.beat:LedgerScheduler"
_CELERY_DEFAULT_SCHEDULER = "celery.beat:PersistentScheduler"


def use_ledger_scheduler(app: Celery) -> None:
    """Make `celery beat` use the ledger-backed scheduler, unless the app chose another.

    Read once the app is configured (a Django project's settings arrive late). Celery's
    own default counts as no choice: it is what an app gets without one.
    """
    chosen = app.conf.beat_scheduler
    if chosen in (None, "", _CELERY_DEFAULT_SCHEDULER):
        app.conf.beat_scheduler = LEDGER_SCHEDULER
    elif chosen != LEDGER_SCHEDULER:
        log.warning(
            "beat_scheduler is %r, so `celery beat` will not fire questpie schedules "
            "(schedule() and options.cron); set it to %r, which also runs beat_schedule",
            chosen,
            LEDGER_SCHEDULER,
        )


#: kombu's default for transports that redeliver unacknowledged messages (Redis, SQS).
DEFAULT_VISIBILITY_TIMEOUT = 3600.0


def visibility_timeout(app: Celery) -> float:
    """Seconds after which the broker itself redelivers an unacknowledged message (0: never)."""
    if broker_kind(app) != "redis":
        return 0.0
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT))


#: Celery options that route a message; when a delivery's are carried, they win.
ROUTING_OPTIONS = ("queue", "exchange", "routing_key")


def carry_from_request(request: Any) -> dict[str, Any]:
    """The Celery options of the delivery being run that a later send should keep: its
    custom headers (tracing context, say), Canvas links and ids, and its route."""
    custom = {k: v for k, v in (getattr(request, "headers", None) or {}).items() if k != HEADER}
    found = {
        "headers": custom,
        "link": getattr(request, "callbacks", None),
        "link_error": getattr(request, "errbacks", None),
        "chain": getattr(request, "chain", None),
        "chord": getattr(request, "chord", None),
        "group_id": getattr(request, "group", None),
        "group_index": getattr(request, "group_index", None),
        "root_id": getattr(request, "root_id", None),
        "parent_id": getattr(request, "parent_id", None),
        **_route_of(getattr(request, "delivery_info", None) or {}),
    }
    carry: dict[str, Any] = {}
    for name, value in found.items():
        if value in (None, {}, []):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            log.info("option %s of a delivery is not JSON; a later send will not keep it", name)
            continue
        carry[name] = value
    return carry


def carry_for_retry(stored: Mapping[str, Any], request: Any) -> dict[str, Any]:
    """What a retry of the delivery being run carries: the delivery's headers and Canvas
    options (the newest), and the route the dispatch was stored with (a publish's `queue`
    stays authoritative; a delivery taken into the ledger stored its own route)."""
    current = carry_from_request(request)
    routing = {k: v for k, v in stored.items() if k in ROUTING_OPTIONS}
    return {**{k: v for k, v in current.items() if k not in ROUTING_OPTIONS}, **routing}


def _route_of(delivery: Mapping[str, Any]) -> dict[str, Any]:
    """Where a delivery came from, as send options (what Celery's own retry does): a
    message to the default exchange names its queue; any other, its exchange and key."""
    exchange, routing_key = delivery.get("exchange"), delivery.get("routing_key")
    if not routing_key:
        return {}
    if exchange == "":
        return {"queue": routing_key}
    if exchange:
        return {"exchange": exchange, "routing_key": routing_key}
    return {}


#: As Celery's own `argsrepr` limit.
ARGSREPR_MAX_LENGTH = 1024


def _short_repr(payload: dict[str, Any] | None) -> str:
    text = repr((payload,))
    return text if len(text) <= ARGSREPR_MAX_LENGTH else text[: ARGSREPR_MAX_LENGTH - 3] + "..."


@dataclass
class _OpenBatch:
    """What the sends of one thread's open `Sender.batch` share."""

    producer: Any
    #: The transport buffers the sends until the batch is flushed (Redis pipelines them).
    buffered: bool
    #: A `task_routes` router may route each message by its arguments.
    routed: bool
    #: The caller's trace context when the batch opened, and its headers.
    context: object
    trace: Mapping[str, str]
    #: A buffered send went through, so the channel is open and later ones do no I/O.
    connected: bool = False
    #: Routes whose queue (and, on Redis, binding) an earlier send declared.
    declared: set[tuple[Any, ...]] = field(default_factory=set)


class Sender:
    """Sends questpie messages through the app's producer pool.

    With `task_always_eager` (which many projects' test suites set), a send runs the
    task inline instead, through the same fence a worker would use.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._local = threading.local()  # `.open`: this thread's open batch, if any
        self._kind: str | None = None
        self._task_settings_seen: dict[str, tuple[str, bool]] = {}

    @contextmanager
    def batch(self, size: int) -> Iterator[None]:
        """Let the sends made inside share one producer connection, pipelined where the
        transport can (kombu's Redis transport sends them in one round trip at the end).

        Raises `BrokerError` on leaving when the broker may not have taken every send
        made inside: with pipelining, which of them arrived is unknown.
        """
        if self.eager or self._open() is not None:
            yield
            return
        raised: BaseException | None = None  # by the caller's block: passed on untouched
        try:
            with self.app.producer_or_acquire() as producer:
                try:
                    batched = getattr(producer, "batch", None)  # kombu 5.7 and later
                    self._local.open = _OpenBatch(
                        producer,
                        # kombu's answer, read without connecting.
                        buffered=batched is not None
                        and bool(getattr(producer, "supports_batch_publish", False)),
                        routed=bool(self.app.conf.task_routes),
                        # One call's sends share the caller's trace context: read once,
                        # for the sends made in that same context (not, say, a publish a
                        # signal handler makes under its own span while the batch is open).
                        context=telemetry.current_context(),
                        trace=telemetry.carrier(),
                    )
                    with batched(max_size=size) if batched else nullcontext():
                        try:
                            yield
                        except BaseException as exc:
                            raised = exc
                            raise
                finally:
                    self._local.open = None
        except Exception as exc:
            if exc is raised or isinstance(exc, BrokerError):
                raise
            raise BrokerError(
                f"the broker may not have taken a batch of sends: {type(exc).__name__}"
            ) from exc

    def forget_broker(self) -> None:
        """The app's broker settings changed (a test's): read the broker's kind again."""
        self._kind = None

    def _open(self) -> _OpenBatch | None:
        opened: _OpenBatch | None = getattr(self._local, "open", None)
        return opened

    @property
    def eager(self) -> bool:
        """Sends run the task inline (`task_always_eager`)."""
        return bool(self.app.conf.task_always_eager)

    def send(
        self,
        *,
        job_name: str,
        dispatch_id: str,
        payload: dict[str, Any] | None,
        header: MessageHeader,
        priority: int | None,
        queue: str | None,
        eta: datetime | None = None,
        countdown: float | None = None,
        carry: Mapping[str, Any] | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> None:
        """Publish one message; raise `BrokerError` if the broker does not take it.

        `trace` is the trace context of the publisher when the send happens elsewhere (a
        send thread); by default the current one is sent."""
        carried = dict(carry or {})
        # Stamped at each send: how old the message is, for a fence that meets no row.
        stamped = {**header.to_dict(), "sent": round(time.time(), 3)}
        headers = {**carried.pop("headers", {}), HEADER: stamped}
        batch = self._open()  # only ever open when not eager
        # The consumer's span continues the sender's trace.
        if trace is not None:
            headers.update(trace)
        elif batch is not None and telemetry.current_context() is batch.context:
            headers.update(batch.trace)
        else:
            telemetry.inject(headers)
        if batch is None and self.eager:
            # Celery's eager mode ignores ETAs as well; what the handler raises propagates
            # exactly as it would from apply_async() when task_eager_propagates is set.
            task = self.app.tasks[job_name]
            ran = task.apply(args=[payload], task_id=dispatch_id, headers=headers, **carried)
            # What Celery's own eager apply_async answers, for a caller that answers it
            # in turn (an adopted task's `delay()`): this thread's last eager run.
            self._local.eager_result = ran
            return
        serializer, own_limits = self._task_settings(job_name)
        options: dict[str, Any] = {
            **carried,
            "task_id": dispatch_id,
            "headers": headers,
            "serializer": serializer,
            # What monitors (Flower, events) show of the arguments. Celery's own saferepr
            # of them costs more than the rest of building the message.
            "argsrepr": _short_repr(payload),
            "kwargsrepr": "{}",
        }
        if not own_limits:
            # Celery enforces these on the prefork pool only; the lease caps the rest.
            options["soft_time_limit"] = header.run.expire_in_seconds
            options["time_limit"] = header.run.expire_in_seconds + HARD_TIME_LIMIT_GRACE_SECONDS
        if self._kind is None:  # read once: the broker URL is fixed once the app is configured
            self._kind = broker_kind(self.app)
        mapped = broker_priority(self._kind, priority)
        if mapped is not None:
            options["priority"] = mapped
        if queue is not None and not any(name in carried for name in ROUTING_OPTIONS):
            options["queue"] = queue
        if batch is None or not batch.connected:
            # The first send of a batch opens the producer's channel: under this policy,
            # so a broker that is down fails it in about a second, not kombu's default.
            options["retry"], options["retry_policy"] = True, dict(PUBLISH_RETRY_POLICY)
        else:
            # The later sends of a buffered batch do no I/O until the batch is flushed as
            # a whole, so kombu's per-send retry could never fire; it cost ~8% of a bulk
            # publish.
            options["retry"] = False
        if batch is not None:
            options["producer"] = batch.producer
            # Within a batch, the first send on a route declares its queue (and, on Redis,
            # its binding); declaring it again for every message would only cost time.
            # Only where the route is known here: a `task_routes` router may route each
            # message by its arguments, to a queue no earlier send declared.
            route = (job_name, *(options.get(name) for name in ROUTING_OPTIONS))
            known = any(options.get(name) for name in ROUTING_OPTIONS)
            if known or not batch.routed:
                if route in batch.declared:
                    options["declare"] = []
                else:
                    batch.declared.add(route)
        if countdown is not None and countdown > 0:
            options["countdown"] = countdown
        elif eta is not None:
            options["eta"] = eta
        try:
            self.app.send_task(job_name, args=[payload], **options)
            if batch is not None:
                batch.connected = batch.buffered
        except Exception as exc:
            # kombu raises OperationalError, socket errors, or transport-specific ones;
            # the caller decides whether that loses anything (it does not for a ledgered
            # dispatch: the row stays in the ledger for the relay).
            raise BrokerError(
                f"the broker did not accept dispatch {dispatch_id} of job {job_name!r}: "
                f"{type(exc).__name__}"
            ) from exc

    def _task_settings(self, job_name: str) -> tuple[str, bool]:
        """The task's own serializer (JSON for a job's task; for an adopted Celery task,
        the one its app accepts: its message carries the serialized call as a string),
        and whether it keeps its own time limits (an adopted task: Celery's, as declared,
        rather than ones made from `expire_in_seconds`)."""
        settings = self._task_settings_seen.get(job_name)
        if settings is None:
            task = self.app.tasks.get(job_name)
            settings = (
                getattr(task, "serializer", None) or "json",
                bool(getattr(task, "questpie_own_time_limits", False)),
            )
            self._task_settings_seen[job_name] = settings
        return settings

    def eager_result(self, dispatch_id: str) -> Any:
        """The `EagerResult` of this thread's last eager run, if it ran `dispatch_id`."""
        ran = getattr(self._local, "eager_result", None)
        self._local.eager_result = None
        return ran if ran is not None and ran.id == dispatch_id else None

    def send_back(self, task: Task, header: MessageHeader, countdown: float) -> None:
        """Send the delivery being run again as it came (its id, arguments, route, time
        limits, headers and Canvas options, as Celery's own `retry()` rebuilds them),
        with `header` as its questpie header; raise `BrokerError` if the broker does
        not take it. Not a row's send: the worker sends it back because the ledger
        cannot be reached, and a plain delivery has no row yet."""
        try:
            signature = task.signature_from_request(task.request)
            headers = dict(signature.options.get("headers") or {})
            headers[HEADER] = header.to_dict()
            signature.options["headers"] = headers
            signature.apply_async(countdown=countdown)
        except Exception as exc:
            raise BrokerError(
                f"the broker did not take delivery {task.request.id} back: {type(exc).__name__}"
            ) from exc
