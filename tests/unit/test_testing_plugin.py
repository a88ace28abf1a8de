"""`questpie_celery.testing`, used as a project would: small projects run with `pytester`.

The projects run in a subprocess where they start Celery apps and workers, so that no
Celery state leaks into this session; the plugin's on/off tests run in-process or in a
subprocess that must not import Celery at all.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from celery import Celery
from pydantic import BaseModel
from sqlalchemy import create_engine

from questpie_celery import JobContext, Questpie, QueuePolicy, derive_dispatch_id, job
from questpie_celery.errors import ConfigurationError

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "testing"

SHOP = """
from celery import Celery
from pydantic import BaseModel

from questpie_celery import JobContext, PermanentFailure, Questpie, job

# Nothing listens on either: the fixtures must need neither the broker nor the ledger.
celery_app = Celery("shop", broker="redis://127.0.0.1:9/0")
PRODUCTION_LEDGER = "sqlite:////nonexistent/folder/production.sqlite3"
runs: list[tuple[str, int]] = []
nested: list[str | None] = []


class Order(BaseModel):
    order_id: str
    fail_times: int = 0
    permanent: bool = False
    nested: bool = False


class Link(BaseModel):
    email: str
    link: str


@job(name="charge", schema=Order, options={"retry_limit": 2})
def charge(payload: Order, ctx: JobContext) -> None:
    runs.append((f"charge {payload.order_id}", ctx.attempt))
    if payload.permanent:
        raise PermanentFailure("declined")
    if ctx.attempt <= payload.fail_times:
        raise RuntimeError("gateway timeout")


@job(name="sync", schema=Order, options={"queue_policy": "exclusive"})
def sync(payload: Order, ctx: JobContext) -> None:
    runs.append((f"sync {payload.order_id}", ctx.attempt))
    if payload.nested:  # the exclusive slot is this run's: a second sync is suppressed
        nested.append(questpie.queue.sync.publish({"order_id": "inner"}))


@job(name="mail-link", schema=Link)
def mail_link(payload: Link, ctx: JobContext) -> None:
    runs.append((f"link {payload.email} {payload.link}", ctx.attempt))


questpie = Questpie(
    celery_app,
    ledger_url=PRODUCTION_LEDGER,
    secret="s" * 40,
    relay_interval=0.1,
    jobs=[charge, sync, mail_link],
)
"""

SHOP_TESTS = '''
import os

import pytest
import shop
from sqlalchemy import create_engine

from questpie_celery import derive_dispatch_id
from questpie_celery.testing import Dispatch, Harness

ledgers: list[str] = []


def order(order_id: str, **fields: object) -> dict[str, object]:
    """An Order payload as stored: validated, so with its defaults."""
    return {"order_id": order_id, "fail_times": 0, "permanent": False, "nested": False,
            **fields}  # fmt: skip


@pytest.fixture(autouse=True)
def _clean() -> None:
    shop.runs.clear()
    shop.nested.clear()


def test_the_ledger_is_migrated(questpie_ledger: Harness) -> None:
    ledgers.append(questpie_ledger.ledger_url)
    assert questpie_ledger.questpie is shop.questpie
    assert os.path.exists(questpie_ledger.ledger_url.removeprefix("sqlite:///"))
    dispatch_id = shop.questpie.queue.charge.publish({"order_id": "o1"}, idempotency_key="a")
    [d] = questpie_ledger.dispatches("charge")
    assert (d.id, d.key, d.payload, d.ledgered) == (dispatch_id, "a", order("o1"), True)
    assert not d.ended and shop.runs == []  # neither eager nor a worker: nothing ran


def test_the_ledger_is_fresh_for_each_test(questpie_ledger: Harness) -> None:
    assert questpie_ledger.ledger_url not in ledgers
    assert questpie_ledger.dispatches("charge") == []


def test_everything_is_put_back_after_a_test() -> None:
    assert "production.sqlite3" in shop.questpie.operator.ledger_label
    assert shop.celery_app.conf.broker_url == "redis://127.0.0.1:9/0"
    assert not shop.celery_app.conf.task_always_eager


def test_eager_a_repeated_key_runs_once_under_one_id(questpie_eager: Harness) -> None:
    first = shop.questpie.queue.charge.publish({"order_id": "o2"}, idempotency_key="k")
    again = shop.questpie.queue.charge.publish({"order_id": "o2"}, idempotency_key="k")
    assert first == again == derive_dispatch_id("charge", "k")
    assert shop.runs == [("charge o2", 1)]
    [d] = questpie_eager.dispatches(shop.charge)
    assert (d.status, d.attempts, d.key) == ("completed", 1, "k")


def test_eager_the_queue_policy_holds(questpie_eager: Harness) -> None:
    outer = shop.questpie.queue.sync.publish({"order_id": "outer", "nested": True})
    assert shop.nested == [None]  # suppressed while the outer run held the slot
    assert [d.id for d in questpie_eager.dispatches(shop.sync)] == [outer]
    assert questpie_eager.wait_for(outer).status == "completed"


def test_eager_retries_run_inline(questpie_eager: Harness) -> None:
    dispatch_id = shop.questpie.queue.charge.publish(
        {"order_id": "o3", "fail_times": 2}, idempotency_key="r", retry_delay=600
    )
    assert [attempt for _, attempt in shop.runs] == [1, 2, 3]
    d = questpie_eager.dispatch(dispatch_id)
    assert d is not None and (d.status, d.attempts, d.last_error) == ("completed", 3, None)


def test_eager_a_failure_is_recorded_not_raised(questpie_eager: Harness) -> None:
    dispatch_id = shop.questpie.queue.charge.publish(
        {"order_id": "o4", "permanent": True}, idempotency_key="p"
    )
    d = questpie_eager.wait_for(dispatch_id)
    assert (d.status, d.attempts, d.last_error) == ("failed", 1, "PermanentFailure")


def test_eager_a_secret_payload_is_never_shown(questpie_eager: Harness) -> None:
    shop.questpie.queue.mail_link.publish(
        {"email": "ada@example.com", "link": "https://x/secret-token"},
        idempotency_key="l", secret_payload=True,
    )
    assert shop.runs == [("link ada@example.com https://x/secret-token", 1)]
    [d] = questpie_eager.dispatches("mail-link")
    assert (d.secret, d.payload, d.status) == (True, None, "completed")
    assert "secret-token" not in repr(questpie_eager.dispatches("mail-link"))


def test_dispatches_in_publish_order_ledgered_or_not(questpie_eager: Harness) -> None:
    queue = shop.questpie.queue
    plain = queue.charge.publish({"order_id": "p1"})
    keyed = queue.charge.publish({"order_id": "p2"}, idempotency_key="k2")
    failed = queue.charge.publish({"order_id": "p3", "permanent": True})
    found = questpie_eager.dispatches(queue.charge)
    assert found == questpie_eager.dispatches("charge") == questpie_eager.dispatches(shop.charge)
    assert found == [
        Dispatch(plain, "charge", None, None, "completed", 1, order("p1"), False,
                 None, False),
        Dispatch(keyed, "charge", "k2", None, "completed", 1, order("p2"), False,
                 None, True),
        Dispatch(failed, "charge", None, None, "failed", 1,
                 order("p3", permanent=True), False, "PermanentFailure", False),
    ]  # fmt: skip
    assert questpie_eager.dispatches("sync") == []


def test_wait_for_says_where_a_dispatch_stands(questpie_ledger: Harness) -> None:
    dispatch_id = shop.questpie.queue.charge.publish({"order_id": "w"}, idempotency_key="w")
    with pytest.raises(TimeoutError, match=r"not ended after 0.2s \\(it is (pending|queued)\\)"):
        questpie_ledger.wait_for(dispatch_id, timeout=0.2)


def test_a_worker_runs_what_is_published(questpie_worker: Harness) -> None:
    keyed = shop.questpie.queue.charge.publish(
        {"order_id": "o5", "fail_times": 1}, idempotency_key="w1"
    )
    plain = shop.questpie.queue.charge.publish({"order_id": "o6"})
    assert questpie_worker.wait_for(keyed).attempts == 2
    d = questpie_worker.wait_for(plain)
    assert (d.status, d.ledgered, d.attempts) == ("completed", False, 1)
    assert sorted(shop.runs) == [("charge o5", 1), ("charge o5", 2), ("charge o6", 1)]


def test_the_worker_runs_a_relay(questpie_worker: Harness) -> None:
    # A publish(connection=...) has no commit hook: only a relay ever sends it.
    engine = create_engine(questpie_worker.ledger_url)
    with engine.begin() as conn:
        dispatch_id = shop.questpie.queue.charge.publish({"order_id": "o7"}, connection=conn)
    engine.dispose()
    assert questpie_worker.wait_for(dispatch_id).status == "completed"
'''


def _project(pytester: pytest.Pytester, ini: str) -> None:
    pytester.makeini(ini)
    pytester.makepyfile(shop=SHOP, test_shop=SHOP_TESTS)


def test_a_project_uses_every_fixture(pytester: pytest.Pytester) -> None:
    """The ledger fixture (migrated, fresh per test, put back after), eager mode through
    the fence (keys, a policy, retries, a failure, a secret), `dispatches()` and
    `wait_for()`, and the in-process worker with its relay."""
    _project(pytester, "[pytest]\nquestpie_celery = true\nquestpie_app = shop:questpie\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=12)


def test_the_plugin_is_off_unless_enabled_and_imports_nothing_heavy(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_off="""
        import sys

        def test_nothing_heavy_is_imported():
            assert "questpie_celery_pytest" in sys.modules  # the entry point is loaded
            for heavy in ("celery", "sqlalchemy", "pydantic", "questpie_celery"):
                assert heavy not in sys.modules, heavy

        def test_no_fixture(questpie_ledger):
            pass
        """
    )
    # Celery's own pytest plugin imports Celery; the question is whether ours does.
    result = pytester.runpytest_subprocess("-p", "no:celery", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*fixture 'questpie_ledger' not found*"])


def test_naming_the_fixtures_module_enables_it_too(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_on="""
        def test_a_sqlite_file_by_default(questpie_ledger_url, tmp_path):
            assert questpie_ledger_url == f"sqlite:///{tmp_path / 'questpie-ledger.sqlite3'}"

        def test_the_app_must_be_named(questpie_ledger):
            pass
        """
    )
    result = pytester.runpytest("-p", "questpie_celery.testing.fixtures", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*does not know the project's Questpie*questpie_app*"])


def _documented_blocks() -> list[str]:
    testing = (ROOT / "docs" / "testing.md").read_text()
    section = testing.split("## Testing your project", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\w*\n(.*?)```", section, flags=re.DOTALL)


def test_the_documented_example_is_the_example_project_and_passes(
    pytester: pytest.Pytester,
) -> None:
    files = {}
    for block in _documented_blocks():
        first = block.splitlines()[0]
        if first.startswith("# ") and (EXAMPLE / first[2:].split(":")[0]).exists():
            name = first[2:].split(":")[0]
            assert block == (EXAMPLE / name).read_text(), f"docs/testing.md's {name} differs"
            files[name] = block
    assert set(files) == {"pytest.ini", "signup.py", "test_signup.py"}
    for name, text in files.items():
        (pytester.path / name).write_text(text)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)


# --- Questpie.rebind_ledger, which the fixtures rely on -------------------------------------


class Item(BaseModel):
    name: str


@job(name="plugin.rebind", schema=Item, options={"queue_policy": "stately"})
def rebind_job(payload: Item, ctx: JobContext) -> None:
    del payload, ctx


def test_rebind_ledger_moves_every_part_and_back(tmp_path: Path) -> None:
    app = Celery("rebind", broker="memory://")
    first = f"sqlite:///{tmp_path / 'one.sqlite3'}"
    questpie = Questpie(app, ledger_url=first, jobs=[rebind_job])
    questpie.migrate()
    questpie.set_policy("plugin.rebind", QueuePolicy.SINGLETON)  # cached, and recorded
    queue = questpie.queue.plugin_rebind
    assert queue.publish({"name": "a"}, idempotency_key="k") == derive_dispatch_id(
        "plugin.rebind", "k"
    )
    one_id = questpie.operator.ledger_label

    previous = questpie.rebind_ledger(ledger_url=f"sqlite:///{tmp_path / 'two.sqlite3'}")
    assert str(previous.url) == first
    questpie.migrate()
    assert questpie.operator.ledger_label != one_id
    assert questpie.get_policy("plugin.rebind") is None  # nothing read from ledger one
    assert questpie.operator.dispatches() == []
    # The declared policy, not ledger one's cached singleton, decides here.
    assert queue.publish({"name": "b"}, idempotency_key="k") is not None
    assert questpie.get_policy("plugin.rebind") == QueuePolicy.STATELY
    assert [d.payload for d in questpie.operator.dispatches()] == [{"name": "b"}]
    # asyncio publishing follows the rebind too.
    assert asyncio.run(queue.apublish({"name": "d"}, idempotency_key="d")) is None  # stately
    assert len(questpie.operator.dispatches()) == 1

    questpie.rebind_ledger(engine=previous).dispose()
    assert questpie.get_policy("plugin.rebind") == QueuePolicy.SINGLETON
    assert [d.payload for d in questpie.operator.dispatches()] == [{"name": "a"}]
    # Ledger one's identity is read again, not kept from two: a transaction on it passes.
    with previous.begin() as conn:
        assert queue.publish({"name": "c"}, idempotency_key="c", connection=conn)
    questpie.close()


def test_rebind_ledger_needs_one_ledger(tmp_path: Path) -> None:
    questpie = Questpie(Celery("rebind2", broker="memory://"), ledger_url="sqlite://")
    with pytest.raises(ConfigurationError, match="exactly one"):
        questpie.rebind_ledger()
    with pytest.raises(ConfigurationError, match="exactly one"):
        questpie.rebind_ledger(ledger_url="sqlite://", engine=create_engine("sqlite://"))
    with pytest.raises(ConfigurationError, match=r"sqlalchemy\.Engine"):
        questpie.rebind_ledger(engine="sqlite://")  # type: ignore[arg-type]
    questpie.close()
