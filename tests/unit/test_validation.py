"""Every invalid publish is rejected before anything reaches the ledger or the broker."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

import pytest

from questpie_celery import PayloadValidationError, PublishOptionsError, QuestpieError
from questpie_celery.jobs.options import FIRE_KEY_PREFIX
from tests.unit.helpers import IdleApp

VALID = {"tag": "v"}
BAD_CALLS: list[tuple[str, Any, dict[str, Any], type[Exception]]] = [
    ("payload missing field", {}, {}, PayloadValidationError),
    ("payload wrong type", {"tag": 5}, {}, PayloadValidationError),
    ("payload not a mapping", ["tag"], {}, PayloadValidationError),
    ("payload of keyed publish", {"sleep": "x"}, {"idempotency_key": "k"}, PayloadValidationError),
    ("empty key", VALID, {"idempotency_key": ""}, PublishOptionsError),
    ("key too long", VALID, {"idempotency_key": "k" * 513}, PublishOptionsError),
    ("key with NUL", VALID, {"idempotency_key": "a\0b"}, PublishOptionsError),
    ("key not a str", VALID, {"idempotency_key": 7}, PublishOptionsError),
    ("both keys", VALID, {"idempotency_key": "a", "singleton_key": "b"}, PublishOptionsError),
    ("secret without key", VALID, {"secret_payload": True}, PublishOptionsError),
    ("secret without secret", VALID, {"secret_payload": True, "idempotency_key": "s"},
     PublishOptionsError),
    ("priority too high", VALID, {"priority": 10}, PublishOptionsError),
    ("priority negative", VALID, {"priority": -1}, PublishOptionsError),
    ("priority bool", VALID, {"priority": True}, PublishOptionsError),
    ("priority float", VALID, {"priority": 1.5}, PublishOptionsError),
    ("start_after negative", VALID, {"start_after": -1}, PublishOptionsError),
    ("start_after naive", VALID, {"start_after": datetime(2030, 1, 1)}, PublishOptionsError),
    ("start_after no offset", VALID, {"start_after": "2030-01-01T00:00:00"}, PublishOptionsError),
    ("start_after garbage", VALID, {"start_after": "soon"}, PublishOptionsError),
    ("start_after nan", VALID, {"start_after": float("nan")}, PublishOptionsError),
    ("start_after bool", VALID, {"start_after": True}, PublishOptionsError),
    ("start_after huge int", VALID, {"start_after": 10**400}, PublishOptionsError),
    ("retry_limit negative", VALID, {"retry_limit": -1}, PublishOptionsError),
    ("retry_limit str", VALID, {"retry_limit": "3"}, PublishOptionsError),
    ("retry_delay negative", VALID, {"retry_delay": -0.5}, PublishOptionsError),
    ("retry_delay inf", VALID, {"retry_delay": float("inf")}, PublishOptionsError),
    ("retry_delay nan", VALID, {"retry_delay": float("nan")}, PublishOptionsError),
    ("retry_delay huge int", VALID, {"retry_delay": 10**400}, PublishOptionsError),
    ("retry_backoff int", VALID, {"retry_backoff": 1}, PublishOptionsError),
    ("expire zero", VALID, {"expire_in_seconds": 0}, PublishOptionsError),
    ("expire float", VALID, {"expire_in_seconds": 1.5}, PublishOptionsError),
    ("queue empty", VALID, {"queue": ""}, PublishOptionsError),
    ("policy unknown", VALID, {"queue_policy": "fifo"}, PublishOptionsError),
    ("session wrong type", VALID, {"session": object()}, PublishOptionsError),
    ("connection wrong type", VALID, {"connection": "conn"}, PublishOptionsError),
]  # fmt: skip


@pytest.mark.parametrize(
    ("payload", "options", "error"),
    [case[1:] for case in BAD_CALLS],
    ids=[case[0] for case in BAD_CALLS],
)
def test_invalid_publish_writes_nothing(
    idle: IdleApp, payload: Any, options: dict[str, Any], error: type[Exception]
) -> None:
    before = idle.written()
    with pytest.raises(error) as caught:
        idle.questpie.queue.record.publish(payload, **options)
    assert isinstance(caught.value, QuestpieError)
    assert isinstance(caught.value, ValueError)
    assert idle.written() == before


@pytest.mark.parametrize(
    "key",
    [
        f"{FIRE_KEY_PREFIX}call:2026-01-01T06:00:00Z",  # exactly what a fire's key looks like
        "QUESTPIE-Schedule:mine",  # SQLite's LIKE, which the beat's pruning uses, ignores case
        FIRE_KEY_PREFIX,
    ],
)
def test_a_key_in_a_namespace_questpie_writes_in_itself_is_refused(idle: IdleApp, key: str) -> None:
    """A key there would be taken for a schedule fire's, whose row the beat deletes once
    it ended: the key would lose its id, and run again."""
    client = idle.questpie.queue.record
    before = idle.written()
    reserved = "questpie writes its own keys there"
    with pytest.raises(PublishOptionsError, match=reserved):
        client.publish(VALID, idempotency_key=key)
    with pytest.raises(PublishOptionsError, match=f"item 1: .*{reserved}"):
        client.publish_many([VALID, VALID], idempotency_keys=["fine", key])
    with pytest.raises(PublishOptionsError, match=reserved):
        asyncio.run(client.apublish(VALID, idempotency_key=key))
    with pytest.raises(PublishOptionsError, match=reserved):
        asyncio.run(client.apublish_many([VALID], idempotency_keys=[key]))
    assert idle.written() == before
    # Only the namespace itself: keys that merely look alike are anyone's.
    for near in ("questpie-schedule", "my-questpie-schedule:x", "questpie-schedules:x"):
        assert client.publish(VALID, idempotency_key=near) is not None


def test_unknown_keyword_is_a_type_error(idle: IdleApp) -> None:
    before = idle.written()
    with pytest.raises(TypeError):
        idle.questpie.queue.record.publish(VALID, idempotency="k")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        idle.questpie.queue.record.publish(VALID, "positional-option")  # type: ignore[call-arg]
    assert idle.written() == before


def test_the_counters_do_see_writes(idle: IdleApp) -> None:
    """Guards the tests above: a valid keyed publish is counted in both places, an
    unkeyed one (no ledger row for a standard job) on the broker only."""
    rows, messages = idle.written()
    idle.questpie.queue.record.publish(VALID, idempotency_key=f"counted-{rows}-{messages}")
    assert idle.written() == (rows + 1, messages + 1)
    idle.questpie.queue.record.publish(VALID)
    assert idle.written() == (rows + 1, messages + 2)


def test_validation_error_does_not_echo_input_values(idle: IdleApp) -> None:
    with pytest.raises(PayloadValidationError) as caught:
        idle.questpie.queue.record.publish({"tag": {"nested": "CANARY-7731"}})
    assert "CANARY-7731" not in str(caught.value)
    # Nothing chained either: pydantic's error holds the input values.
    assert caught.value.__cause__ is None
    assert caught.value.__context__ is None
    assert "tag" in str(caught.value)


def test_option_errors_do_not_echo_the_key(idle: IdleApp) -> None:
    with pytest.raises(PublishOptionsError) as caught:
        idle.questpie.queue.record.publish(VALID, idempotency_key="CANARY-5512\0")
    assert "CANARY-5512" not in str(caught.value)
    assert "idempotency_key" in str(caught.value)
