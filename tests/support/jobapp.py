"""The Celery project the integration tests run in real `celery worker` processes.

Configured only from the environment, so a worker subprocess and the test process
build the same app:

- QP_TEST_BROKER: Celery broker URL (for `filesystem://`, QP_TEST_FS_DIR is the folder)
- QP_TEST_BACKEND: optional result backend URL
- QP_TEST_LEDGER: SQLAlchemy URL of the ledger
- QP_TEST_POOLED: set when that URL goes through a pooler in transaction mode
  (PgBouncer): the ledger is then opened with `pooled=True`
- QP_TEST_RUNS: SQLAlchemy URL of the `test_runs` table (default: the ledger's database)
- QP_TEST_QUEUE: the default queue (each stack has its own)
- QP_TEST_LEASE: lease length in seconds; QP_TEST_RELAY: relay interval
- QP_TEST_SECRET, QP_TEST_PREVIOUS (comma-separated): the secret and older ones
- QP_TEST_EXTENDED: turn on result_extended, task events and track_started
- QP_TEST_RETENTION, QP_TEST_FIRE_RETENTION: retention periods in seconds
- QP_TEST_HOLD_DIR: every delivery, before it reaches questpie's task (so before its
  claim), writes its pool process's pid to `<dir>/<dispatch id>` and waits for
  `<dir>/<dispatch id>.go`; only the first delivery of each dispatch id is held, so a
  test can kill a pool process at exactly that moment and watch the next delivery run
- QP_TEST_TIMER_FILE: the worker's main process writes there, twice a second, how many
  cancelled entries its event loop's timer holds, and the most it held; QP_TEST_PURGE:
  how often it drops them
- QP_TEST_DELIVERIES: a folder; each process that runs tasks appends there, to a file
  named by its pid, the id of every delivery it starts, before the fence sees it, so a
  test that kills the process knows what it held
- QP_TEST_BEAT_TAG: a beat entry that calls the adopted `adopted.rebuild_index` every
  second, its runs recorded under this tag
- QP_TEST_SERIALIZER: the app's task and result serializer (`pickle` for the adopted
  tasks of `adoptedapp.py`, as a project that sends dataclasses has it)
- QP_TEST_QUEUE_TYPE: `quorum` declares every queue Celery creates as a RabbitMQ quorum
  queue; QP_TEST_CONFIRM: turn on publisher confirms (`confirm_publish`)
- QP_TEST_KILL_AFTER_RUN: a folder; a pool process SIGKILLs itself once its task
  returned, the first time for each task id
- QP_TEST_CARRY: how long a completion waits for the next claim of its process to carry
  it (`worker/carried.py`), in seconds

Handlers record each run in `test_runs`, so tests observe what really ran. A
handler given a `gate` (a file path) records its start and then waits until the
test creates that file: a run stays `active` exactly as long as the test wants.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import time
from typing import Any

from celery import Celery, signals
from celery.exceptions import SoftTimeLimitExceeded
from kombu import Queue
from pydantic import BaseModel, ConfigDict
from sqlalchemy import (
    Column,
    DateTime,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    func,
    insert,
    select,
    update,
)

from questpie_celery import JobContext, PermanentFailure, Questpie, job
from questpie_celery.worker import carried, hub_timer
from tests.support.waiting import wait_until

runs_metadata = MetaData()
runs_table = Table(
    "test_runs",
    runs_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_name", String(200), nullable=False),
    Column("tag", String(200), nullable=False),
    Column("dispatch_id", Text, nullable=False),  # a plain call's task id: any length
    Column("attempt", Integer, nullable=False),
    Column("idempotency_key", String(600), nullable=True),
    Column("pid", Integer, nullable=False),
    Column("phase", String(8), nullable=False, server_default="start"),
    Column("note", String(200), nullable=True),
    Column("ran_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
#: A store of the handlers' own that takes the fencing token with each write.
fenced_table = Table(
    "test_fenced",
    runs_metadata,
    Column("key", Text, primary_key=True),
    Column("value", Text, nullable=True),
    Column("token", Integer, nullable=False),
)


def make_celery(
    broker: str,
    backend: str | None = None,
    fs_dir: str | None = None,
    queue: str = "celery",
    extended: bool = False,
    priority_queue: str | None = None,
    queue_type: str = "classic",
    confirm_publish: bool = False,
    serializer: str = "json",
) -> Celery:
    # The adopted Celery tasks (`base=LedgerTask`) are shared tasks of that module.
    app = Celery(
        "questpie_tests",
        broker=broker,
        backend=backend,
        include=["tests.support.adoptedapp", "tests.support.canvasapp"],
    )
    conf: dict[str, Any] = {
        "task_serializer": serializer,
        "result_serializer": serializer,
        "accept_content": sorted({serializer, "json"}),
        "task_default_queue": queue,
        "worker_prefetch_multiplier": 1,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
    }
    if priority_queue:
        # RabbitMQ needs x-max-priority declared on the queue; questpie never redeclares.
        conf["task_queues"] = [
            Queue(queue),
            Queue(priority_queue, queue_arguments={"x-max-priority": 9}),
        ]
    if queue_type == "quorum":
        # Celery's own RabbitMQ advice: quorum queues, the default one and every one it
        # creates on first use. It turns global QoS off by itself once it sees them.
        conf["task_default_queue_type"] = "quorum"
        conf["task_create_missing_queue_type"] = "quorum"
    if confirm_publish:
        conf["broker_transport_options"] = {"confirm_publish": True}
    if extended:
        # Everything Celery can record about a task, so the canary test sees it all.
        conf.update(
            result_extended=True,
            worker_send_task_events=True,
            task_send_sent_event=True,
            task_track_started=True,
        )
    if broker.startswith("filesystem"):
        assert fs_dir is not None, "the filesystem broker needs a folder"
        os.makedirs(fs_dir, exist_ok=True)
        conf["broker_transport_options"] = {
            "data_folder_in": fs_dir,
            "data_folder_out": fs_dir,
            # kombu's default is a folder named "control" in the working directory.
            "control_folder": os.path.join(fs_dir, "control"),
            "store_processed": False,
            "polling_interval": 0.1,
        }
    app.conf.update(conf)
    # A plain Celery task, the callback of a chord whose header is questpie jobs.
    app.task(name="tests.gather", shared=False)(gather)
    return app


def gather(results: list[Any]) -> list[Any]:
    return sorted(results, key=str)


_engines: dict[int, Engine] = {}


def runs_url() -> str:
    return os.environ.get("QP_TEST_RUNS") or os.environ["QP_TEST_LEDGER"]


def runs_engine() -> Engine:
    """One engine per process: a pool must not cross fork."""
    pid = os.getpid()
    if pid not in _engines:
        _engines[pid] = create_engine(runs_url())
    return _engines[pid]


def wait_at(gate: str | None) -> None:
    """Block until the test opens the gate (creates the file)."""
    if gate is None:
        return
    wait_until(lambda: os.path.exists(gate), f"gate {gate} to open", 120, 0.01)


def record(ctx: JobContext, tag: str, phase: str = "start", note: str | None = None) -> None:
    with runs_engine().begin() as conn:
        conn.execute(
            insert(runs_table).values(
                job_name=ctx.job_name,
                tag=tag,
                dispatch_id=ctx.dispatch_id,
                attempt=ctx.attempt,
                idempotency_key=ctx.idempotency_key,
                pid=os.getpid(),
                phase=phase,
                note=note,
            )
        )


class Work(BaseModel):
    tag: str
    sleep: float = 0.0
    fail_times: int = 0
    permanent: bool = False
    hang_attempts: int = 0  # sleep 60 s on attempts up to this one: a stuck run
    gate: str | None = None  # wait for this file to exist after recording the start
    gate_attempts: int = 1_000  # ... on attempts up to this one only
    raise_base: str | None = None  # raise this BaseException class (by name) instead


def policy_handler(payload: Work, ctx: JobContext) -> None:
    """Records a start and an end row, so tests can see whether runs overlapped."""
    record(ctx, payload.tag)
    if ctx.attempt <= payload.gate_attempts:
        wait_at(payload.gate)
    time.sleep(60 if ctx.attempt <= payload.hang_attempts else payload.sleep)
    if ctx.attempt <= payload.fail_times:
        raise RuntimeError("planned failure")
    record(ctx, payload.tag, phase="end")


def watch_for_cancel(payload: Work, ctx: JobContext) -> None:
    """Runs until `ctx.cancel_requested` turns true (30 s at most), notes whether it did,
    then fails: a failure that would be retried, had the run not been cancelled."""
    record(ctx, payload.tag)
    deadline = time.monotonic() + 30
    while not ctx.cancel_requested and time.monotonic() < deadline:
        time.sleep(0.05)
    record(ctx, payload.tag, phase="end", note=f"cancel_requested={ctx.cancel_requested}")
    if ctx.attempt <= payload.fail_times:
        raise RuntimeError("stopped after the cancel")


#: Cancellation (tests/integration/test_cancel.py): a run that watches for its cancel,
#: retried twice were it not cancelled.
CANCEL_JOBS = (job(name="cancel.watch", schema=Work, options={"retry_limit": 2})(watch_for_cancel),)


POLICY_JOBS = tuple(
    job(name=f"policy.{policy}", schema=Work, options={"queue_policy": policy})(policy_handler)
    for policy in ("short", "singleton", "stately", "exclusive")
)


#: Jobs with flow-control limits (tests/integration/test_limits.py): two runs at once per
#: group; one at once, never retried; four starts a second per group.
LIMIT_JOBS = (
    job(
        name="limit.concurrency",
        schema=Work,
        options={"concurrency_limit": 2, "retry_limit": 1},
    )(policy_handler),
    job(name="limit.one", schema=Work, options={"concurrency_limit": 1, "retry_limit": 0})(
        policy_handler
    ),
    job(name="limit.rate", schema=Work, options={"rate_limit": "4/s"})(policy_handler),
)


def fenced_handler(payload: Work, ctx: JobContext) -> None:
    """`policy_handler` noting its run's fencing token, and at its end writing to a store
    that refuses a write with a smaller token than one it took (the recipe the docs give):
    the note of the end row says whether the write was taken."""
    record(ctx, payload.tag, note=f"token={ctx.fencing_token}")
    if ctx.attempt <= payload.gate_attempts:
        wait_at(payload.gate)
    time.sleep(payload.sleep)
    taken = write_fenced(ctx.dispatch_id, f"attempt {ctx.attempt}", ctx.fencing_token)
    record(ctx, payload.tag, phase="end", note=f"token={ctx.fencing_token} taken={taken}")


def write_fenced(key: str, value: str, token: int) -> bool:
    """Write `value` under `key` unless a write with a larger token came first."""
    with runs_engine().begin() as conn:
        seen = conn.execute(
            select(fenced_table.c.token).where(fenced_table.c.key == key).with_for_update()
        ).scalar()
        if seen is None:
            conn.execute(insert(fenced_table).values(key=key, value=value, token=token))
            return True
        if seen > token:
            return False
        conn.execute(
            update(fenced_table).where(fenced_table.c.key == key).values(value=value, token=token)
        )
        return True


#: Fencing tokens (test_limits.py, test_fence.py): one run at a time, retried after a
#: lapse; the other's time cap lapses its claim while its thread goes on.
FENCED_JOBS = (
    job(name="fenced.one", schema=Work, options={"concurrency_limit": 1, "retry_limit": 2})(
        fenced_handler
    ),
    job(name="fenced.capped", schema=Work, options={"expire_in_seconds": 1, "retry_limit": 1})(
        fenced_handler
    ),
)


@job(
    name="policy.singleton.overrun",
    schema=Work,
    options={"queue_policy": "singleton", "expire_in_seconds": 2},
)
def overrun(payload: Work, ctx: JobContext) -> None:
    """Attempts up to `hang_attempts` run for `sleep` seconds whatever the time limits say
    (a soft limit is caught and noted), recording a `tick` row as they go. Every attempt
    notes, as it starts, whether an earlier attempt's process is still alive."""
    with runs_engine().connect() as conn:
        earlier = conn.execute(
            select(runs_table.c.pid).where(
                runs_table.c.dispatch_id == ctx.dispatch_id, runs_table.c.phase == "start"
            )
        ).scalars()
        alive = [pid for pid in earlier if pid != os.getpid() and _process_alive(pid)]
    record(ctx, payload.tag, note=f"earlier alive: {alive}" if alive else "alone")
    until = time.monotonic() + (payload.sleep if ctx.attempt <= payload.hang_attempts else 0)
    while time.monotonic() < until:
        try:
            record(ctx, payload.tag, phase="tick")
            time.sleep(0.2)
        except SoftTimeLimitExceeded:
            pass  # overrun on purpose
        except Exception:
            runs_engine().dispose()  # the limit fell mid-statement: a fresh connection
    record(ctx, payload.tag, phase="end")


def _process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in status)
    except FileNotFoundError:
        return False


@job(name="record", schema=Work)
def record_job(payload: Work, ctx: JobContext) -> str:
    record(ctx, payload.tag)
    if ctx.attempt <= payload.gate_attempts:
        wait_at(payload.gate)
    if payload.sleep:
        time.sleep(payload.sleep)
    if payload.raise_base == "SystemExit":
        raise SystemExit(3)
    if payload.raise_base == "CancelledError":
        raise asyncio.CancelledError()
    if payload.permanent:
        raise PermanentFailure("asked to fail for good")
    if ctx.attempt <= payload.fail_times:
        raise RuntimeError(f"planned failure on attempt {ctx.attempt}")
    record(ctx, payload.tag, phase="end")
    return payload.tag


@job(name="record.async", schema=Work, options={"retry_limit": 1})
async def record_async(payload: Work, ctx: JobContext) -> str:
    await asyncio.sleep(payload.sleep)
    record(ctx, payload.tag)
    if ctx.attempt <= payload.fail_times:
        raise RuntimeError("planned failure")
    return payload.tag


@job(name="send-welcome-email", schema=Work, options={"retry_limit": 3, "priority": 4})
def send_welcome_email(payload: Work, ctx: JobContext) -> None:
    record(ctx, payload.tag)


class SecretWork(BaseModel):
    tag: str
    link: str  # the secret: a one-time link, say
    sleep: float = 0.0
    fail_times: int = 0
    permanent: bool = False
    gate: str | None = None


@job(name="secret.link", schema=SecretWork, options={"retry_limit": 2})
def secret_link(payload: SecretWork, ctx: JobContext) -> str:
    # Prove the plaintext arrived without writing it anywhere: record its digest.
    record(ctx, payload.tag, note=hashlib.sha256(payload.link.encode()).hexdigest())
    wait_at(payload.gate)
    time.sleep(payload.sleep)
    if payload.permanent:
        raise PermanentFailure(f"cannot deliver {payload.link}")
    if ctx.attempt <= payload.fail_times:
        raise RuntimeError(f"mail server rejected {payload.link}")
    return f"sent {payload.link}"  # a return value that echoes the secret


class Anything(BaseModel):
    """A permissive schema: any object validates."""

    model_config = ConfigDict(extra="allow")

    tag: str = "anything"


@job(name="permissive", schema=Anything)
def permissive(payload: Anything, ctx: JobContext) -> None:
    # Records a digest of whatever it was handed, so a test can tell whose payload it got.
    dumped = json.dumps(payload.model_dump(), sort_keys=True)
    record(ctx, payload.tag, note=hashlib.sha256(dumped.encode()).hexdigest())


JOBS = (
    record_job,
    record_async,
    send_welcome_email,
    *CANCEL_JOBS,
    *POLICY_JOBS,
    *LIMIT_JOBS,
    *FENCED_JOBS,
    overrun,
    secret_link,
    permissive,
)


# --- debounce and throttle (tests/integration/test_debounce_throttle.py) ----------------


class Burst(BaseModel):
    tag: str
    seq: str = ""  # which publish of a burst this payload was


@job(
    name="debounce.record",
    schema=Burst,
    options={"debounce_seconds": 1.0, "debounce_max_seconds": 3.0},
)
def debounce_record(payload: Burst, ctx: JobContext) -> None:
    record(ctx, payload.tag, note=payload.seq)


@job(
    name="debounce.singleton",
    schema=Work,
    options={"debounce_seconds": 0.5, "queue_policy": "singleton"},
)
def debounce_singleton(payload: Work, ctx: JobContext) -> None:
    policy_handler(payload, ctx)


@job(name="throttle.record", schema=Work, options={"throttle_seconds": 2.0})
def throttle_record(payload: Work, ctx: JobContext) -> None:
    record(ctx, payload.tag)


JOBS = (*JOBS, debounce_record, debounce_singleton, throttle_record)


def build(
    *,
    broker: str,
    ledger: str,
    backend: str | None = None,
    fs_dir: str | None = None,
    lease_seconds: float = 60.0,
    relay_interval: float = 2.0,
    queue: str = "celery",
    secret: str | None = None,
    previous_secrets: tuple[str, ...] = (),
    extended: bool = False,
    redeliver_after: float = 3600.0,
    visibility_timeout: float | None = None,
    priority_queue: str | None = None,
    durability: str = "durable",
    fire_retention: float | None = None,
    retention: float | None = None,
    pooled: bool = False,
    queue_type: str = "classic",
    confirm_publish: bool = False,
    serializer: str = "json",
) -> tuple[Celery, Questpie]:
    app = make_celery(
        broker,
        backend,
        fs_dir,
        queue,
        extended,
        priority_queue,
        queue_type,
        confirm_publish,
        serializer,
    )
    if visibility_timeout is not None:
        app.conf.broker_transport_options = {
            **(app.conf.broker_transport_options or {}),
            "visibility_timeout": visibility_timeout,
        }
    questpie = Questpie(
        app,
        ledger_url=ledger,
        jobs=JOBS,
        lease_seconds=lease_seconds,
        relay_interval=relay_interval,
        secret=secret,
        previous_secrets=previous_secrets,
        redeliver_after=redeliver_after,
        durability="relaxed" if durability == "relaxed" else "durable",
        pooled=pooled,
        **({"fire_retention": fire_retention} if fire_retention is not None else {}),
        **({"retention": retention} if retention is not None else {}),
    )
    return app, questpie


def build_from_env() -> tuple[Celery, Questpie]:
    return build(
        broker=os.environ.get("QP_TEST_BROKER", "memory://"),
        ledger=os.environ.get("QP_TEST_LEDGER", "sqlite://"),
        backend=os.environ.get("QP_TEST_BACKEND") or None,
        fs_dir=os.environ.get("QP_TEST_FS_DIR"),
        lease_seconds=float(os.environ.get("QP_TEST_LEASE", "60")),
        relay_interval=float(os.environ.get("QP_TEST_RELAY", "2")),
        queue=os.environ.get("QP_TEST_QUEUE", "celery"),
        secret=os.environ.get("QP_TEST_SECRET") or None,
        previous_secrets=tuple(filter(None, os.environ.get("QP_TEST_PREVIOUS", "").split(","))),
        extended=bool(os.environ.get("QP_TEST_EXTENDED")),
        redeliver_after=float(os.environ.get("QP_TEST_REDELIVER", "3600")),
        visibility_timeout=_optional_float(os.environ.get("QP_TEST_VISIBILITY")),
        priority_queue=os.environ.get("QP_TEST_PRIORITY_QUEUE") or None,
        durability=os.environ.get("QP_TEST_DURABILITY", "durable"),
        fire_retention=_optional_float(os.environ.get("QP_TEST_FIRE_RETENTION")),
        retention=_optional_float(os.environ.get("QP_TEST_RETENTION")),
        pooled=bool(os.environ.get("QP_TEST_POOLED")),
        queue_type=os.environ.get("QP_TEST_QUEUE_TYPE", "classic"),
        confirm_publish=bool(os.environ.get("QP_TEST_CONFIRM")),
        serializer=os.environ.get("QP_TEST_SERIALIZER", "json"),
    )


def _optional_float(value: str | None) -> float | None:
    return float(value) if value else None


def _report_cancelled_timers(sender: Any, **_: Any) -> None:
    """In the worker's main process: keep QP_TEST_TIMER_FILE up to date with how many
    cancelled entries (finished runs' time limits) the event loop's timer holds."""
    path, hub = os.environ.get("QP_TEST_TIMER_FILE"), getattr(sender, "hub", None)
    if not path or hub is None:
        return

    most = 0

    def write() -> None:
        nonlocal most
        cancelled = sum(1 for item in hub.timer._queue if item[2].canceled)
        most = max(most, cancelled)
        with open(path + ".tmp", "w") as out:
            out.write(f"{cancelled} {most}")
        os.replace(path + ".tmp", path)

    hub.call_repeatedly(0.5, write)


def _hold_before_the_claim(task_id: str | None = None, **_: Any) -> None:
    """In a pool process, before questpie's task runs: see QP_TEST_HOLD_DIR."""
    folder = os.environ.get("QP_TEST_HOLD_DIR")
    if not folder or task_id is None:
        return
    marker = os.path.join(folder, task_id)
    try:
        open(marker + ".seen", "x").close()  # only the first delivery of the id
    except FileExistsError:
        return
    with open(marker + ".tmp", "w") as out:
        out.write(str(os.getpid()))
    os.replace(marker + ".tmp", marker)  # whole, or not there
    wait_at(marker + ".go")


def _die_after_the_run(task_id: str | None = None, **_: Any) -> None:
    """In a pool process, once its task returned (the fence is done with the delivery):
    SIGKILL the process, the first time for each task id. See QP_TEST_KILL_AFTER_RUN."""
    folder = os.environ.get("QP_TEST_KILL_AFTER_RUN")
    if not folder or task_id is None:
        return
    try:
        open(os.path.join(folder, task_id + ".killed"), "x").close()
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _note_delivery(task_id: str | None = None, **_: Any) -> None:
    folder = os.environ.get("QP_TEST_DELIVERIES")
    if folder and task_id:
        with open(os.path.join(folder, str(os.getpid())), "a") as out:
            out.write(task_id + "\n")


signals.task_prerun.connect(_note_delivery, weak=False)

if os.environ.get("QP_TEST_PURGE"):
    hub_timer.PURGE_EVERY_SECONDS = float(os.environ["QP_TEST_PURGE"])
if os.environ.get("QP_TEST_CARRY"):
    carried.CARRY_SECONDS = float(os.environ["QP_TEST_CARRY"])
signals.worker_ready.connect(_report_cancelled_timers, weak=False)
signals.task_prerun.connect(_hold_before_the_claim, weak=False)
signals.task_postrun.connect(_die_after_the_run, weak=False)

# What `celery -A tests.jobapp:celery_app worker` runs; tests build their own with build().
celery_app, questpie = build_from_env()
if os.environ.get("QP_TEST_BEAT_TAG"):
    # A beat entry of an adopted task, unchanged: its call as the project wrote it.
    celery_app.conf.beat_schedule = {
        "adopted-rebuild": {
            "task": "adopted.rebuild_index",
            "schedule": 1.0,
            "args": ("beat", os.environ["QP_TEST_BEAT_TAG"]),
        }
    }
