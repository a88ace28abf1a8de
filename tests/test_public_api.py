"""The fixed public surface (SPEC section 2) and registration rules."""

from __future__ import annotations

import pkgutil
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from pydantic import BaseModel
from sqlalchemy import inspect

import questpie_celery
from questpie_celery import (
    JobContext,
    JobDefinition,
    JobDefinitionError,
    PermanentFailure,
    Questpie,
    QuestpieError,
    UnknownJobError,
    job,
)
from questpie_celery.cli import main
from questpie_celery.jobs import job_attribute_name
from questpie_celery.ledger import create_ledger_engine


class Empty(BaseModel):
    pass


def _noop(payload: Empty, ctx: JobContext) -> None:
    del payload, ctx


def _questpie(**kwargs: Any) -> Questpie:
    return Questpie(Celery("api", broker="memory://"), ledger_url="sqlite://", **kwargs)


def test_all_matches_the_exports() -> None:
    exported = {name for name in dir(questpie_celery) if not name.startswith("_")}
    modules = {m.name for m in pkgutil.iter_modules(questpie_celery.__path__)}
    assert set(questpie_celery.__all__) == exported - modules
    for name in ("Questpie", "job", "JobContext", "PermanentFailure", "QuestpieError", "Receipt"):
        assert name in questpie_celery.__all__


def test_every_error_derives_from_questpie_error() -> None:
    for name in questpie_celery.__all__:
        value = getattr(questpie_celery, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, QuestpieError), name
    assert issubclass(PermanentFailure, QuestpieError)


@pytest.mark.parametrize(
    ("name", "attribute"),
    [("send-welcome-email", "send_welcome_email"), ("Billing.Invoice:v2", "billing_invoice_v2"),
     ("a--b__c", "a_b_c"), ("X", "x")],
)  # fmt: skip
def test_attribute_naming(name: str, attribute: str) -> None:
    assert job_attribute_name(name) == attribute


@pytest.mark.parametrize("name", ["", "-lead", "has space", "x" * 201, "é", "a/b"])
def test_invalid_job_names_are_rejected(name: str) -> None:
    with pytest.raises(JobDefinitionError):
        job(name=name, schema=Empty)(_noop)


def test_job_decorator_validates_schema_and_options() -> None:
    with pytest.raises(JobDefinitionError):
        job(name="x", schema=dict)(_noop)  # type: ignore[type-var]
    with pytest.raises(JobDefinitionError, match="unknown job option"):
        job(name="x", schema=Empty, options={"idempotency_key": "k"})(_noop)  # type: ignore[typeddict-unknown-key]
    with pytest.raises(JobDefinitionError, match="priority"):
        job(name="x", schema=Empty, options={"priority": 10})(_noop)


def test_registration_creates_a_celery_task_named_after_the_job() -> None:
    definition = job(name="send-welcome-email", schema=Empty, options={"retry_limit": 3})(_noop)
    assert isinstance(definition, JobDefinition)
    questpie = _questpie(jobs=[definition])
    assert questpie.celery_app.tasks["send-welcome-email"].name == "send-welcome-email"
    assert questpie.queue.send_welcome_email is questpie.queue["send-welcome-email"]
    assert questpie.client(definition) is questpie.queue.send_welcome_email


def test_colliding_attribute_names_are_an_error() -> None:
    questpie = _questpie(jobs=[job(name="a-b", schema=Empty)(_noop)])
    with pytest.raises(JobDefinitionError, match=r"queue\.a_b"):
        questpie.register(job(name="a.b", schema=Empty)(_noop))
    with pytest.raises(JobDefinitionError, match="twice"):
        questpie.register(job(name="a-b", schema=Empty)(_noop))


def test_questpie_job_shortcut_registers() -> None:
    questpie = _questpie()

    @questpie.job(name="shortcut", schema=Empty)
    def shortcut(payload: Empty, ctx: JobContext) -> None:
        del payload, ctx

    assert questpie.queue.shortcut.definition is shortcut
    assert "shortcut" in questpie.celery_app.tasks


def test_unknown_jobs_name_the_known_ones() -> None:
    questpie = _questpie(jobs=[job(name="known-job", schema=Empty)(_noop)])
    with pytest.raises(AttributeError, match="known-job"):
        _ = questpie.queue.nope
    with pytest.raises(KeyError, match="known-job") as caught:
        _ = questpie.queue["nope"]
    assert isinstance(caught.value, UnknownJobError)


def test_receipt_is_none_for_unknown_ids() -> None:
    questpie = _questpie()
    questpie.migrate()
    assert questpie.queue.get_receipt("00000000-0000-0000-0000-000000000000") is None
    assert questpie.queue.get_receipt(12) is None  # type: ignore[arg-type]


def test_configuration_errors() -> None:
    app = Celery("api", broker="memory://")
    with pytest.raises(QuestpieError, match="exactly one"):
        Questpie(app)
    with pytest.raises(QuestpieError, match="exactly one"):
        Questpie(app, ledger_url="sqlite://", engine=create_ledger_engine("sqlite://"))
    with pytest.raises(QuestpieError):
        Questpie(app, ledger_url="sqlite://", lease_seconds=0)
    with pytest.raises(QuestpieError):
        Questpie("not an app", ledger_url="sqlite://")  # type: ignore[arg-type]


def test_redis_apps_get_ten_priority_steps() -> None:
    app = Celery("api", broker="redis://127.0.0.1:1/0")
    Questpie(app, ledger_url="sqlite://")
    options = app.conf.broker_transport_options
    assert options["priority_steps"] == list(range(10))
    assert options["queue_order_strategy"] == "priority"


def test_cli_migrate(tmp_path: str) -> None:
    url = f"sqlite:///{tmp_path}/cli.sqlite3"
    runner = CliRunner()
    for _ in range(2):  # idempotent
        result = runner.invoke(main, ["migrate", "--ledger-url", url])
        assert result.exit_code == 0, result.output
        assert "version 1" in result.output
    engine = create_ledger_engine(url)
    assert "questpie_queue_dispatch" in inspect(engine).get_table_names()
    engine.dispose()
    assert runner.invoke(main, ["migrate"]).exit_code != 0
