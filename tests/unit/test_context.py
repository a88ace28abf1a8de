"""`Questpie(context=...)`: the per-run application services handlers get as `ctx.app`.

Runs go through eager mode (`task_always_eager`), which takes the same fence and ledger
(a real SQLite file) as a worker, so set-up, close and their failures are observed in
the attempts the ledger records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pydantic import BaseModel

from questpie_celery import ConfigurationError, DispatchStatus, JobContext, Questpie, job
from questpie_celery.jobs.options import RunOptions
from questpie_celery.send.broker import MessageHeader

SECRET = "c" * 40


@dataclass
class Services:
    """What a factory builds: one per run, numbered in the order they were made."""

    number: int
    closed: bool = False


@dataclass
class Journal:
    """What the factories and handlers of one test did, in order."""

    events: list[tuple[str, Any]] = field(default_factory=list)
    seen: list[Any] = field(default_factory=list)  # ctx.app of each handler call
    made: int = 0

    def services(self) -> Services:
        self.made += 1
        return Services(self.made)

    def reset(self) -> None:
        self.events.clear()
        self.seen.clear()
        self.made = 0


journal = Journal()


class Order(BaseModel):
    tag: str = "t"
    fail_times: int = 0
    redeliver: bool = False


class Link(BaseModel):
    link: str


@job(name="ctx.record", schema=Order, options={"retry_limit": 2})
def record(payload: Order, ctx: JobContext[Services]) -> str:
    journal.seen.append(ctx.app)
    journal.events.append(("handler", ctx.attempt))
    if payload.redeliver:
        # A second copy of this very message while this run holds the claim.
        journal.events.append(("redelivered", deliver_again(ctx.dispatch_id, payload)))
    if ctx.attempt <= payload.fail_times:
        raise RuntimeError("planned failure")
    return payload.tag


@job(name="ctx.once", schema=Order, options={"retry_limit": 0})
def once(payload: Order, ctx: JobContext[Services]) -> None:
    journal.seen.append(ctx.app)
    if payload.fail_times:
        raise ValueError("the handler's own error")


@job(name="ctx.async", schema=Order, options={"retry_limit": 0})
async def record_async(payload: Order, ctx: JobContext[Services]) -> None:
    await asyncio.sleep(0)
    journal.seen.append(ctx.app)
    journal.events.append(("handler-loop", id(asyncio.get_running_loop())))


@job(name="ctx.sync", schema=Order, options={"retry_limit": 0})
def record_sync(payload: Order, ctx: JobContext[Services]) -> None:
    journal.seen.append(ctx.app)
    journal.events.append(("handler-loop", asyncio._get_running_loop()))


@job(name="ctx.bare", schema=Order)
def bare(payload: Order, ctx: JobContext) -> None:
    journal.seen.append(ctx.app)


@job(name="ctx.secret", schema=Link, options={"retry_limit": 0})
def secret_job(payload: Link, ctx: JobContext[Services]) -> None:
    journal.seen.append(ctx.app)
    raise RuntimeError(f"mail server rejected {payload.link}")


JOBS = [record, once, record_async, record_sync, bare, secret_job]
current: list[Questpie] = []


def deliver_again(dispatch_id: str, payload: Order) -> str:
    """Hand the task the message of `dispatch_id` again, as a broker delivering it twice
    would; returns the state Celery ends it with."""
    header = MessageHeader(ledgered=True, attempt=1, run=RunOptions(retry_limit=2))
    task = current[0].tasks["ctx.record"]
    result = task.apply(
        args=[{**payload.model_dump(), "redeliver": False}],
        task_id=dispatch_id,
        headers={"questpie": header.to_dict()},
    )
    return str(result.state)


Make = Callable[..., Questpie]


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Make]:
    """A Questpie in eager mode on a SQLite file: `make(context=factory)`."""
    made: list[Questpie] = []

    def build(**kwargs: Any) -> Questpie:
        app = Celery("ctx", broker="memory://")
        app.conf.task_always_eager = True
        questpie = Questpie(
            app, ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}", jobs=JOBS, **kwargs
        )
        questpie.migrate()
        made.append(questpie)
        current[:] = [questpie]
        return questpie

    journal.reset()
    yield build
    for questpie in made:
        questpie.close()


def status(questpie: Questpie, dispatch_id: str | None) -> DispatchStatus:
    found = questpie.queue.get_status(dispatch_id or "")
    assert found is not None
    return found


class Tracked:
    """A class-based context manager: what `__enter__` returns is not the manager."""

    def __init__(self, fail_enter: bool = False, fail_exit: int = 0, swallow: bool = False):
        self.fail_enter = fail_enter
        self.fail_exit = fail_exit  # how many exits raise, first ones first
        self.swallow = swallow

    def __call__(self) -> Tracked:  # the factory: a new manager per run
        return self

    def __enter__(self) -> Services:
        services = journal.services()
        journal.events.append(("enter", services.number))
        if self.fail_enter:
            raise ConnectionError("database unreachable")
        self.services = services
        return services

    def __exit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> bool:
        self.services.closed = True
        journal.events.append(("exit", kind.__name__ if kind else None))
        if self.fail_exit:
            self.fail_exit -= 1
            raise OSError(f"commit failed after {exc}")
        return self.swallow


# --- what ctx.app is ----------------------------------------------------------------------


def test_without_a_factory_ctx_app_is_none(make: Make) -> None:
    questpie = make()
    questpie.queue.ctx_bare.publish({})  # unfenced: a plain message
    questpie.queue.ctx_bare.publish({}, idempotency_key="k")  # fenced
    assert journal.seen == [None, None]


def test_a_plain_object_is_used_as_it_is_one_per_run(make: Make) -> None:
    questpie = make(context=journal.services)
    questpie.queue.ctx_record.publish({}, idempotency_key="a")
    questpie.queue.ctx_record.publish({})
    assert journal.seen == [Services(1), Services(2)]
    assert journal.made == 2


def test_a_context_manager_is_entered_and_exited_once_per_attempt_also_on_failure(
    make: Make,
) -> None:
    questpie = make(context=Tracked())
    dispatch_id = questpie.queue.ctx_record.publish({"fail_times": 1}, idempotency_key="cm")
    assert status(questpie, dispatch_id).status == "completed"
    assert journal.events == [
        ("enter", 1),
        ("handler", 1),
        ("exit", "RuntimeError"),  # told how the handler ended, so it can roll back
        ("enter", 2),
        ("handler", 2),
        ("exit", None),
    ]
    # ctx.app is what __enter__ returned, and it was closed after its run.
    assert journal.seen == [Services(1, closed=True), Services(2, closed=True)]


def test_a_contextmanager_generator_works_and_the_unfenced_path_gets_it(make: Make) -> None:
    @contextmanager
    def services() -> Iterator[Services]:
        made = journal.services()
        journal.events.append(("enter", made.number))
        try:
            yield made
        finally:
            journal.events.append(("exit", made.number))

    questpie = make(context=services)
    dispatch_id = questpie.queue.ctx_record.publish({"fail_times": 1})  # no ledger row
    assert questpie.queue.get_status(dispatch_id or "") is None
    # Celery's own retry (unledgered) gets a fresh context too.
    assert journal.events == [
        ("enter", 1),
        ("handler", 1),
        ("exit", 1),
        ("enter", 2),
        ("handler", 2),
        ("exit", 2),
    ]


@asynccontextmanager
async def services_noting_their_loop() -> AsyncIterator[Services]:
    """An async context manager that notes the loop it is entered and exited in."""
    journal.events.append(("enter-loop", id(asyncio.get_running_loop())))
    yield journal.services()
    journal.events.append(("exit-loop", id(asyncio.get_running_loop())))


def test_an_async_context_manager_and_an_async_handler_share_one_loop(make: Make) -> None:
    questpie = make(context=services_noting_their_loop)
    dispatch_id = questpie.queue.ctx_async.publish({}, idempotency_key="async")
    assert status(questpie, dispatch_id).status == "completed"
    assert [name for name, _ in journal.events] == ["enter-loop", "handler-loop", "exit-loop"]
    assert len({loop for _, loop in journal.events}) == 1
    assert journal.seen == [Services(1)]


def test_an_async_context_manager_and_a_sync_handler_use_a_loop_of_their_own(
    make: Make,
) -> None:
    questpie = make(context=services_noting_their_loop)
    dispatch_id = questpie.queue.ctx_sync.publish({}, idempotency_key="sync")
    assert status(questpie, dispatch_id).status == "completed"
    (_, entered), (_, in_handler), (_, exited) = journal.events
    assert entered == exited  # set up and closed in the same loop
    assert in_handler is None  # the sync handler runs with no loop running
    assert journal.seen == [Services(1)]


def test_an_object_of_both_kinds_is_used_as_the_kind_of_the_handler(make: Make) -> None:
    class Both:
        def __enter__(self) -> str:
            return "sync"

        def __exit__(self, *end: object) -> None:
            journal.events.append(("exit", "sync"))

        async def __aenter__(self) -> str:
            return "async"

        async def __aexit__(self, *end: object) -> None:
            journal.events.append(("exit", "async"))

    questpie = make(context=Both)
    questpie.queue.ctx_sync.publish({}, idempotency_key="s")
    questpie.queue.ctx_async.publish({}, idempotency_key="a")
    assert journal.seen == ["sync", "async"]
    assert [e for e in journal.events if e[0] == "exit"] == [("exit", "sync"), ("exit", "async")]


# --- failures of set-up and close -------------------------------------------------------------


def test_a_failing_set_up_fails_the_attempt_and_it_is_retried(make: Make) -> None:
    calls = 0

    def flaky() -> Services:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("database unreachable")
        return journal.services()

    questpie = make(context=flaky)
    dispatch_id = questpie.queue.ctx_record.publish({}, idempotency_key="setup")
    found = status(questpie, dispatch_id)
    assert (found.status, found.attempt) == ("completed", 2)
    assert journal.events == [("handler", 2)]  # attempt 1 never reached the handler


def test_a_failing_enter_is_recorded_and_nothing_is_closed(make: Make) -> None:
    questpie = make(context=Tracked(fail_enter=True))
    dispatch_id = questpie.queue.ctx_once.publish({}, idempotency_key="enter")
    found = status(questpie, dispatch_id)
    assert (found.status, found.attempt, found.last_error) == ("failed", 1, "ConnectionError")
    assert journal.events == [("enter", 1)]
    assert journal.seen == []


def test_a_failing_close_after_success_fails_the_attempt_and_it_is_retried(make: Make) -> None:
    questpie = make(context=Tracked(fail_exit=1))
    dispatch_id = questpie.queue.ctx_record.publish({}, idempotency_key="close")
    found = status(questpie, dispatch_id)
    # A close that commits and fails lost the handler's work: the run is done again.
    assert (found.status, found.attempt) == ("completed", 2)
    assert [e for e in journal.events if e[0] == "handler"] == [("handler", 1), ("handler", 2)]


def test_a_failing_close_after_a_handler_error_keeps_the_handlers_error(
    make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    questpie = make(context=Tracked(fail_exit=1))
    with caplog.at_level(logging.WARNING, logger="questpie_celery.jobs.context"):
        dispatch_id = questpie.queue.ctx_once.publish({"fail_times": 1}, idempotency_key="both")
    found = status(questpie, dispatch_id)
    assert (found.status, found.last_error) == ("failed", "ValueError")
    assert "closing its context raised OSError" in caplog.text
    assert "after the handler raised ValueError" in caplog.text


def test_a_context_cannot_swallow_the_handlers_error(make: Make) -> None:
    questpie = make(context=Tracked(swallow=True))
    dispatch_id = questpie.queue.ctx_once.publish({"fail_times": 1}, idempotency_key="swallow")
    found = status(questpie, dispatch_id)
    assert (found.status, found.last_error) == ("failed", "ValueError")


def test_a_factory_returning_a_coroutine_fails_the_attempt_clearly(make: Make) -> None:
    async def services() -> Services:
        return journal.services()

    def factory() -> Any:
        return services()  # an async def called, not awaited: a coroutine

    questpie = make(context=factory)
    dispatch_id = questpie.queue.ctx_once.publish({}, idempotency_key="coroutine")
    found = status(questpie, dispatch_id)
    assert (found.status, found.last_error) == ("failed", "TypeError")
    assert journal.made == 0


def test_a_secret_dispatchs_context_errors_log_no_plaintext(
    make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    link = "https://example.com/login?token=PLAINTEXT-7f3a"
    questpie = make(context=Tracked(fail_exit=1), secret=SECRET)
    with caplog.at_level(logging.DEBUG):
        dispatch_id = questpie.queue.ctx_secret.publish(
            {"link": link}, idempotency_key="secret", secret_payload=True
        )
    receipt = questpie.queue.get_receipt(dispatch_id or "")
    assert receipt is not None and receipt.status == "failed"
    assert status(questpie, dispatch_id).last_error == "RuntimeError"
    # The close error's message quoted the handler's, which quoted the link.
    assert "closing its context raised OSError" in caplog.text
    assert "PLAINTEXT" not in caplog.text


# --- when a context is built ----------------------------------------------------------------


def test_a_duplicate_delivery_builds_nothing(make: Make) -> None:
    questpie = make(context=Tracked())
    dispatch_id = questpie.queue.ctx_record.publish({"redeliver": True}, idempotency_key="dup")
    assert dispatch_id is not None
    # The copy delivered while the run held its claim was turned away unbuilt.
    assert journal.events == [
        ("enter", 1),
        ("handler", 1),
        ("redelivered", "IGNORED"),
        ("exit", None),
    ]
    # So is a copy delivered after the dispatch completed, and a repeated key's publish.
    assert deliver_again(dispatch_id, Order()) == "IGNORED"
    assert questpie.queue.ctx_record.publish({}, idempotency_key="dup") == dispatch_id
    assert journal.made == 1


# --- swapping the factory for tests ---------------------------------------------------------


def test_override_context_swaps_the_factory_and_restores_it(make: Make) -> None:
    questpie = make(context=journal.services)
    fake = Services(number=-1)
    with questpie.override_context(lambda: fake):
        questpie.queue.ctx_record.publish({})
        with questpie.override_context(None):
            questpie.queue.ctx_record.publish({})
        questpie.queue.ctx_record.publish({})
    questpie.queue.ctx_record.publish({})
    assert journal.seen == [fake, None, fake, Services(1)]


def test_override_context_restores_the_factory_when_the_block_raises(make: Make) -> None:
    questpie = make()
    with pytest.raises(KeyError), questpie.override_context(journal.services):
        raise KeyError("a failing test")
    questpie.queue.ctx_record.publish({})
    assert journal.seen == [None]


# --- the argument ---------------------------------------------------------------------------


async def _async_factory() -> Services:
    return Services(0)


def _generator_factory() -> Iterator[Services]:
    yield Services(0)


async def _async_generator_factory() -> AsyncIterator[Services]:
    yield Services(0)


@pytest.mark.parametrize(
    ("factory", "says"),
    [
        (42, "zero-argument callable"),
        (_async_factory, "async def"),
        (_generator_factory, "contextlib.contextmanager"),
        (_async_generator_factory, "contextlib.contextmanager"),
    ],
)
def test_a_factory_that_cannot_work_is_refused(make: Make, factory: object, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        make(context=factory)
    questpie = make()
    with pytest.raises(ConfigurationError, match=says), questpie.override_context(factory):  # type: ignore[arg-type]
        pass


# --- what a second hostile review found ------------------------------------------------


class Slow(BaseModel):
    sleep_attempts: int = 1


@job(name="ctx.slow", schema=Slow, options={"retry_limit": 1, "expire_in_seconds": 1})
def slow(payload: Slow, ctx: JobContext[Services]) -> None:
    journal.events.append(("handler", ctx.attempt))
    if ctx.attempt <= payload.sleep_attempts:
        time.sleep(1.2)  # past the run's time cap: its claim is no longer this run's


def test_a_run_past_its_claim_closes_its_context_as_failed(make: Make) -> None:
    """A context that commits on close must not commit the work of a run whose claim
    lapsed: it is told `ClaimLostError`, the attempt fails, and the retry's is told
    success."""
    questpie = make(context=Tracked())
    questpie.register(slow)
    dispatch_id = questpie.queue.ctx_slow.publish({}, idempotency_key="slow")
    assert journal.events == [
        ("enter", 1),
        ("handler", 1),
        ("exit", "ClaimLostError"),
        ("enter", 2),
        ("handler", 2),
        ("exit", None),
    ]
    ended = status(questpie, dispatch_id)
    assert (ended.status, ended.attempt) == ("completed", 2)


def test_an_async_context_works_for_eager_runs_published_from_a_coroutine(make: Make) -> None:
    """Eager mode called inside a running loop (an `async def` test) cannot run the
    context's loop in that thread: it runs in one of its own."""

    @asynccontextmanager
    async def services() -> AsyncIterator[Services]:
        yield journal.services()

    questpie = make(context=services)

    async def main() -> tuple[str | None, str | None]:
        return (
            questpie.queue.ctx_sync.publish({}, idempotency_key="in-loop-sync"),
            questpie.queue.ctx_async.publish({}, idempotency_key="in-loop-async"),
        )

    for dispatch_id in asyncio.run(main()):
        assert status(questpie, dispatch_id).status == "completed"
    assert [type(app) for app in journal.seen] == [Services, Services]
