"""The `questpie` header: every header questpie writes reads back as written, and any
other is a `MalformedHeaderError` naming the field, never its value."""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from questpie_celery.errors import InvalidInputError, MalformedHeaderError
from questpie_celery.jobs.options import MAX_EXPIRE_IN_SECONDS, MAX_RETRY_DELAY_SECONDS, RunOptions
from questpie_celery.send.broker import HEADER, MAX_ATTEMPT, MessageHeader

run_options = st.builds(
    RunOptions,
    retry_limit=st.integers(0, 10**6),
    retry_delay=st.one_of(st.floats(0, MAX_RETRY_DELAY_SECONDS), st.integers(0, 3600).map(float)),
    retry_backoff=st.booleans(),
    expire_in_seconds=st.integers(1, MAX_EXPIRE_IN_SECONDS),
)
headers = st.builds(
    MessageHeader,
    ledgered=st.booleans(),
    attempt=st.integers(1, MAX_ATTEMPT),
    run=run_options,
    token=st.one_of(st.none(), st.uuids().map(str)),
    sent_at=st.one_of(st.none(), st.floats(1.0, 4e9)),
)


@given(header=headers)
def test_every_header_questpie_writes_reads_back_as_written(header: MessageHeader) -> None:
    written = header.to_dict()
    assert MessageHeader.parse(written) == header
    # Through the broker's JSON (Redis) as well.
    assert MessageHeader.parse(json.loads(json.dumps(written))) == header


def test_the_headers_of_sends_retries_and_trips_back_read_back() -> None:
    # A send stamps `sent`; a retry names a later attempt; a delivery sent back to the
    # broker carries its token; a plain call's header is not ledgered.
    sent = {**MessageHeader(True, 3, RunOptions(retry_backoff=True)).to_dict(), "sent": 1e9}
    assert MessageHeader.parse(sent).attempt == 3 and MessageHeader.parse(sent).sent_at == 1e9
    token = str(uuid.uuid4())
    back = MessageHeader(False, 1, RunOptions(), token).to_dict()
    assert MessageHeader.parse(back).token == token
    stamped = {**MessageHeader(True).to_dict(), "sent": round(time.time(), 3)}
    assert MessageHeader.parse(stamped).sent_at == stamped["sent"]
    # What a newer sender adds is left alone; a missing run option is its default.
    assert MessageHeader.parse({**sent, "future": [1, 2]}).attempt == 3
    short = {"v": 1, "ledgered": True, "attempt": 1, "run": {}}
    assert MessageHeader.parse(short) == MessageHeader(True)


class Request:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def test_a_plain_call_has_no_header_and_a_bad_one_is_an_error() -> None:
    assert MessageHeader.from_request(Request(headers={})) is None
    assert MessageHeader.from_request(Request(headers=None)) is None
    good = MessageHeader(True, 2).to_dict()
    assert MessageHeader.from_request(Request(**{HEADER: good})) == MessageHeader(True, 2)
    assert MessageHeader.from_request(Request(headers={HEADER: good})) == MessageHeader(True, 2)
    with pytest.raises(MalformedHeaderError):
        MessageHeader.from_request(Request(headers={HEADER: "v1"}))


GOOD: dict[str, Any] = {
    "v": 1,
    "ledgered": True,
    "attempt": 1,
    "run": RunOptions().to_dict(),
    "token": str(uuid.uuid4()),
    "sent": 1.7e9,
}
CANARY = "CANARY-2718"
MALFORMED: list[tuple[str, Any, str]] = [
    ("not a mapping", [CANARY], "not a mapping"),
    ("a string", CANARY, "not a mapping"),
    ("no version", {k: v for k, v in GOOD.items() if k != "v"}, "version"),
    ("a later version", {**GOOD, "v": 2}, "version"),
    ("a version in text", {**GOOD, "v": "1"}, "version"),
    ("a version that is True", {**GOOD, "v": True}, "version"),
    ("ledgered missing", {k: v for k, v in GOOD.items() if k != "ledgered"}, "ledgered"),
    ("ledgered in text", {**GOOD, "ledgered": "yes"}, "ledgered"),
    ("attempt missing", {k: v for k, v in GOOD.items() if k != "attempt"}, "attempt"),
    ("attempt 2**40", {**GOOD, "attempt": 2**40}, "attempt"),
    ("attempt 0", {**GOOD, "attempt": 0}, "attempt"),
    ("attempt negative", {**GOOD, "attempt": -3}, "attempt"),
    ("attempt a float", {**GOOD, "attempt": 1.0}, "attempt"),
    ("attempt True", {**GOOD, "attempt": True}, "attempt"),
    ("attempt in text", {**GOOD, "attempt": CANARY}, "attempt"),
    ("run not a mapping", {**GOOD, "run": CANARY}, "run"),
    ("run missing", {k: v for k, v in GOOD.items() if k != "run"}, "run"),
    ("retry_limit negative", {**GOOD, "run": {"retry_limit": -1}}, "retry_limit"),
    ("retry_limit in text", {**GOOD, "run": {"retry_limit": CANARY}}, "retry_limit"),
    ("retry_delay NaN", {**GOOD, "run": {"retry_delay": math.nan}}, "retry_delay"),
    ("retry_delay huge", {**GOOD, "run": {"retry_delay": 10**400}}, "retry_delay"),
    ("retry_backoff 1", {**GOOD, "run": {"retry_backoff": 1}}, "retry_backoff"),
    ("expire_in_seconds 0", {**GOOD, "run": {"expire_in_seconds": 0}}, "expire_in_seconds"),
    ("expire a year", {**GOOD, "run": {"expire_in_seconds": 10**9}}, "expire_in_seconds"),
    ("token short", {**GOOD, "token": CANARY}, "token"),
    ("token 36 characters", {**GOOD, "token": CANARY.ljust(36, "x")}, "token"),
    ("token in capitals", {**GOOD, "token": GOOD["token"].upper()}, "token"),
    ("token a number", {**GOOD, "token": 36}, "token"),
    ("sent negative", {**GOOD, "sent": -1.0}, "sent"),
    ("sent NaN", {**GOOD, "sent": math.nan}, "sent"),
    ("sent infinite", {**GOOD, "sent": math.inf}, "sent"),
    ("sent huge", {**GOOD, "sent": 10**400}, "sent"),
    ("sent in text", {**GOOD, "sent": CANARY}, "sent"),
    ("sent True", {**GOOD, "sent": True}, "sent"),
]


@pytest.mark.parametrize(
    ("raw", "field"), [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED]
)
def test_a_malformed_header_names_what_is_wrong_and_never_its_value(raw: Any, field: str) -> None:
    assert MessageHeader.parse(GOOD) is not None  # the header it was made from is fine
    with pytest.raises(MalformedHeaderError) as caught:
        MessageHeader.parse(raw)
    assert isinstance(caught.value, InvalidInputError)
    assert field in str(caught.value)
    assert CANARY not in str(caught.value)
