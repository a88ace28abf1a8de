"""The relay's side of the ledger: batch takes (backoff, give-back, three relays taking
at once) and wake-ups at commit, on both dialects (no broker, no worker)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import update

from questpie_celery.ledger import DispatchRow, Ledger, dispatch_table, open_ledger
from questpie_celery.ledger.statements import RELAY_WAKE_CHANNEL
from tests.support.ledgers import new_row, row_of

BACKOFF = {"first_backoff": 2.0, "max_backoff": 3600.0, "accepted_backoff": 100.0}


def _due(ledger: Ledger, count: int, **values: Any) -> list[str]:
    """`count` rows due for the relay now, with `values` written over them."""
    ids = []
    for _ in range(count):
        new = new_row(idempotency_key=None, send_in=0.0)
        assert ledger.dispatches.insert(new) is True
        ids.append(new.id)
    if values:
        with ledger.engine.begin() as conn:
            t = dispatch_table.c
            conn.execute(update(dispatch_table).where(t.id.in_(ids)).values(**values))
    return ids


def _due_after(row: DispatchRow, seconds: float, before: datetime, after: datetime) -> bool:
    """Whether `row` is due `seconds` after a moment between `before` and `after` (the
    database's clock read around the statement that set it)."""
    assert row.next_send_at is not None
    ahead = timedelta(seconds=seconds)
    return before + ahead <= row.next_send_at <= after + ahead


def test_take_due_counts_each_send_and_backs_it_off(ledger: Ledger) -> None:
    fresh = _due(ledger, 2)
    resent = _due(ledger, 1, send_count=3)
    capped = _due(ledger, 1, send_count=20)
    accepted = _due(ledger, 1, status="queued")
    spent = _due(ledger, 1, send_count=25)
    _due(ledger, 1, next_send_at=datetime.now(UTC) + timedelta(hours=1))  # not due yet
    before = ledger.now()
    taken = ledger.relay.take_due(100, max_sends=25, **BACKOFF)
    after = ledger.now()
    assert sorted(r.id for r in taken) == sorted(fresh + resent + capped + accepted)
    by_id = {r.id: r for r in taken}
    expected = {
        fresh[0]: (1, 2.0),
        fresh[1]: (1, 2.0),
        resent[0]: (4, 16.0),  # 2 ** (sends so far + 1)
        capped[0]: (21, 3600.0),  # capped
        accepted[0]: (1, 100.0),  # never sooner than the accepted floor
    }
    for dispatch_id, (count, ahead) in expected.items():
        assert by_id[dispatch_id].send_count == count
        assert _due_after(by_id[dispatch_id], ahead, before, after), (ahead, before, after)
    # Backed off: not due again. Out of sends: left for give_up.
    assert ledger.relay.take_due(100, max_sends=25, **BACKOFF) == []
    assert [r.id for r in ledger.relay.due_out_of_sends(25)] == spent


def test_give_back_uncounts_only_the_take_it_names(ledger: Ledger) -> None:
    first, second = _due(ledger, 2)
    taken = {r.id: r for r in ledger.relay.take_due(10, max_sends=25, **BACKOFF)}
    before = ledger.now()
    ledger.relay.give_back([taken[first]], send_in=5.0)
    after = ledger.now()
    row = row_of(ledger, first)
    assert row.send_count == 0 and _due_after(row, 5.0, before, after), (row, before, after)
    # Taken again since (by another relay, say): an older take's give-back changes nothing.
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == second)
            .values(send_count=2, next_send_at=datetime.now(UTC) + timedelta(seconds=8))
        )
    ledger.relay.give_back([taken[second]], send_in=5.0)
    assert row_of(ledger, second).send_count == 2


def test_relays_taking_at_once_never_share_a_row(ledger: Ledger) -> None:
    ids = set(_due(ledger, 600))
    url = ledger.engine.url.render_as_string(hide_password=False)
    relays = [open_ledger(url) for _ in range(3)]
    start = threading.Barrier(len(relays))
    taken: list[list[str]] = [[] for _ in relays]

    def drain(index: int) -> None:
        start.wait()
        while batch := relays[index].relay.take_due(25, max_sends=25, **BACKOFF):
            taken[index] += [row.id for row in batch]

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(relays))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for relay in relays:
        relay.close()
    every = [dispatch_id for batch in taken for dispatch_id in batch]
    assert sorted(every) == sorted(ids), "a row taken twice, or never"
    assert all(row_of(ledger, i).send_count == 1 for i in ids)


def test_wake_relays_notifies_listeners_at_commit_only(ledger: Ledger) -> None:
    wakeups = ledger.relay.send_wakeups()
    if ledger.dialect == "sqlite":
        assert wakeups is None  # SQLite has no notifications: relays poll
        with ledger.engine.begin() as conn:
            ledger.relay.wake_relays(conn)  # and waking them is a no-op
        return
    assert wakeups is not None
    # The caller's transactions: not the ledger's own autocommit.
    caller = ledger.engine.execution_options(isolation_level="READ COMMITTED")
    heard = Notifications(ledger)  # every notification on the relays' channel, in order
    wakeups.open()
    try:
        # Nothing to hear yet: the wait's own timeout (what it measures) runs out.
        assert wakeups.wait(0.1) is False
        with caller.begin() as conn:
            ledger.relay.wake_relays(conn)
            ledger.relay.wake_relays(conn)
            assert heard.until_control() == [], "notified before the commit"
        assert heard.until_control() == [""], "one commit, one wake-up"
        assert wakeups.wait(5) is True  # the relay's listener heard it (and the controls)
        with caller.connect() as conn:
            transaction = conn.begin()
            ledger.relay.wake_relays(conn)
            transaction.rollback()
        assert heard.until_control() == [], "a rolled-back transaction woke the relays"
    finally:
        wakeups.close()
        heard.close()


class Notifications:
    """A listener of our own on the relays' channel that reads what each notification
    says. `until_control()` sends a control notification from a connection of its own
    (committed at once) and returns the payloads heard before it: notifications are
    delivered in the order their transactions committed, so anything committed before
    the control, or by a transaction still open, shows (or not) by then."""

    def __init__(self, ledger: Ledger) -> None:
        url = ledger.engine.url.set(drivername="postgresql")
        self._url = url.render_as_string(hide_password=False)
        self._listening = psycopg.connect(self._url, autocommit=True)
        self._listening.execute(f"LISTEN {RELAY_WAKE_CHANNEL}")
        self._controls = 0

    def until_control(self) -> list[str]:
        self._controls += 1
        control = f"control-{self._controls}"
        with psycopg.connect(self._url, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (RELAY_WAKE_CHANNEL, control))
        before: list[str] = []
        for notification in self._listening.notifies(timeout=10):
            if notification.payload == control:
                return before
            before.append(notification.payload)
        raise AssertionError(f"the control notification {control} never came: {before}")

    def close(self) -> None:
        self._listening.close()
