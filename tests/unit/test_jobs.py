"""Payload handling of a job definition: what crosses the broker, and what errors say."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from questpie_celery import JobContext, PayloadValidationError, job


class Address(BaseModel):
    city: str


class Signup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: str = Field(alias="userId")
    link: SecretStr
    scores: dict[str, int] = {}
    address: Address | None = None


def _noop(payload: Signup, ctx: JobContext) -> None:
    del payload, ctx


signup = job(name="signup", schema=Signup)(_noop)


def test_dump_unwraps_secrets_and_uses_aliases_so_the_worker_can_validate_it() -> None:
    body = signup.to_json({"userId": "u1", "link": "https://x.test/once"})
    assert body == {"userId": "u1", "link": "https://x.test/once", "scores": {}, "address": None}
    again = signup.validate(body)  # what the worker does with the message
    assert again.link.get_secret_value() == "https://x.test/once"
    model = Signup.model_validate({"userId": "u2", "link": "s", "address": {"city": "Brno"}})
    assert signup.to_json(model)["address"] == {"city": "Brno"}


def test_errors_name_schema_fields_and_mask_everything_from_the_input() -> None:
    with pytest.raises(PayloadValidationError) as caught:
        signup.validate(
            {
                "userId": "u",
                "link": "s",
                "scores": {"KEY-FROM-INPUT": "not a number"},
                "address": {"city": 5},
                "EXTRA-FROM-INPUT": 1,
            }
        )
    message = str(caught.value)
    assert "scores.[key]: int_parsing" in message
    assert "address.city: string_type" in message
    assert "[key]: extra_forbidden" in message
    assert "FROM-INPUT" not in message
    assert caught.value.__context__ is None and caught.value.__cause__ is None
