"""The public surface and the registration rules."""

from __future__ import annotations

import dataclasses
import inspect as inspect_module
import os
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any, get_args
from unittest import mock

import pytest
from celery import Celery
from click.testing import CliRunner
from pydantic import BaseModel
from sqlalchemy import inspect

import questpie_celery
from questpie_celery import (
    ConfigurationError,
    DispatchStatus,
    HandlerAbortedError,
    JobContext,
    JobDefinition,
    JobDefinitionError,
    PermanentFailure,
    Questpie,
    QuestpieError,
    QueuePolicy,
    QueuePolicyName,
    SecretDecryptionError,
    SecretJobError,
    UnknownJobError,
    job,
)
from questpie_celery.cli.commands import main
from questpie_celery.intake import recorded_policy
from questpie_celery.jobs.definition import job_attribute_name
from questpie_celery.ledger import SCHEMA_VERSION, create_ledger_engine, open_ledger
from tests.unit.helpers import IdleApp

NEW_EXPORTS = (
    "QueuePolicy",
    "QueuePolicyName",
    "DispatchStatus",
    "HandlerAbortedError",
    "SecretDecryptionError",
    "SecretJobError",
)


class Empty(BaseModel):
    pass


def _noop(payload: Empty, ctx: JobContext) -> None:
    del payload, ctx


def _questpie(**kwargs: Any) -> Questpie:
    return Questpie(Celery("api", broker="memory://"), ledger_url="sqlite://", **kwargs)


def test_all_matches_the_exports() -> None:
    # Not the names pytest's assertion rewriting adds to a module it rewrites (`@py_builtins`):
    # it rewrites every module of a distribution that ships a pytest plugin, as this one does.
    exported = {
        name for name in dir(questpie_celery) if name.isidentifier() and not name.startswith("_")
    }
    modules = {m.name for m in pkgutil.iter_modules(questpie_celery.__path__)}
    assert set(questpie_celery.__all__) == exported - modules
    assert len(questpie_celery.__all__) == len(set(questpie_celery.__all__))
    for name in ("Questpie", "job", "JobContext", "PermanentFailure", "QuestpieError", "Receipt"):
        assert name in questpie_celery.__all__
    for name in NEW_EXPORTS:
        assert name in questpie_celery.__all__


def test_new_exports_are_what_they_say() -> None:
    assert issubclass(QueuePolicy, StrEnum)
    assert isinstance(QueuePolicy.STATELY, str)
    assert str(QueuePolicy.STATELY) == "stately"
    assert set(get_args(QueuePolicyName)) == {str(policy) for policy in QueuePolicy}
    assert dataclasses.is_dataclass(DispatchStatus)
    fields = {f.name for f in dataclasses.fields(DispatchStatus)}
    # A status is safe to show anywhere: it holds no payload and no key material.
    assert not fields & {"payload", "secret_ciphertext", "secret_wrapped_key", "options"}
    for error in (HandlerAbortedError, SecretDecryptionError, SecretJobError):
        assert issubclass(error, QuestpieError)
    assert SecretDecryptionError().retryable is False
    assert SecretDecryptionError(retryable=True).retryable is True


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
        job(name="x", schema=dict)(_noop)  # type: ignore[type-var, arg-type]
    with pytest.raises(JobDefinitionError, match="unknown job option"):
        job(name="x", schema=Empty, options={"idempotency_key": "k"})(_noop)  # type: ignore[arg-type]
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


def test_receipt_and_status_are_none_for_unknown_ids() -> None:
    questpie = _questpie()
    questpie.migrate()
    assert questpie.queue.get_receipt("00000000-0000-0000-0000-000000000000") is None
    assert questpie.queue.get_receipt(12) is None  # type: ignore[arg-type]
    assert questpie.queue.get_status("00000000-0000-0000-0000-000000000000") is None
    assert questpie.queue.get_status(12) is None  # type: ignore[arg-type]
    questpie.close()


def test_get_status_describes_a_ledgered_dispatch_and_none_an_unledgered_one(
    tmp_path: Path,
) -> None:
    idle = IdleApp.build(tmp_path)
    try:
        keyed = idle.questpie.queue.record.publish({"tag": "s"}, idempotency_key="status:1")
        assert keyed is not None
        status = idle.questpie.queue.get_status(keyed)
        assert isinstance(status, DispatchStatus)
        assert (status.dispatch_id, status.job_name, status.idempotency_key) == (
            keyed,
            "record",
            "status:1",
        )
        assert status.status in ("pending", "queued")  # accepted, no worker reads the queue
        assert (status.attempt, status.secret, status.last_error) == (0, False, None)
        assert status.started_at is None and status.finished_at is None
        assert status.created_at.tzinfo is not None
        # A plain (unkeyed, standard) dispatch has no row, so no status.
        plain = idle.questpie.queue.record.publish({"tag": "s"})
        assert plain is not None
        assert idle.questpie.queue.get_status(plain) is None
        # And a receipt is only for secret dispatches.
        assert idle.questpie.queue.get_receipt(keyed) is None
    finally:
        idle.close()


def test_a_questpie_without_a_ledger_is_refused_outside_django() -> None:
    """In a fresh process: the suite's Django admin tests configure Django in theirs, and
    there a Questpie with no ledger given lives in Django's database."""
    code = (
        "from celery import Celery\n"
        "from questpie_celery import ConfigurationError, Questpie\n"
        "try:\n"
        "    Questpie(Celery('api', broker='memory://'))\n"
        "except ConfigurationError as exc:\n"
        "    assert 'exactly one' in str(exc), exc\n"
        "    assert 'INSTALLED_APPS' in str(exc), exc  # and how a Django project does it\n"
        "else:\n"
        "    raise SystemExit('no ConfigurationError')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=Path(__file__).parents[2])


def test_configuration_errors() -> None:
    app = Celery("api", broker="memory://")
    with pytest.raises(QuestpieError, match="exactly one"):
        Questpie(app, ledger_url="sqlite://", engine=create_ledger_engine("sqlite://"))
    with pytest.raises(QuestpieError):
        Questpie(app, ledger_url="sqlite://", lease_seconds=0)
    with pytest.raises(QuestpieError):
        Questpie("not an app", ledger_url="sqlite://")


def test_pooled_is_a_flag_and_a_pooled_ledger_never_listens() -> None:
    app = Celery("api", broker="memory://")
    with pytest.raises(ConfigurationError, match="pooled"):
        Questpie(app, ledger_url="sqlite://", pooled="yes")  # type: ignore[arg-type]
    url = "postgresql+psycopg://app@127.0.0.1:1/app"  # never connected to
    unpooled, pooled = open_ledger(url), open_ledger(url, pooled=True)
    # A LISTEN through a pooler in transaction mode stays on a server connection that
    # other clients use next, and delivers nothing: a pooled ledger's relays poll.
    assert pooled.pooled and pooled.relay.send_wakeups() is None
    assert unpooled.relay.send_wakeups() is not None


def test_redis_apps_get_ten_priority_steps() -> None:
    app = Celery("api", broker="redis://127.0.0.1:1/0")
    Questpie(app, ledger_url="sqlite://")
    options = app.conf.broker_transport_options
    assert options["priority_steps"] == list(range(10))
    assert options["queue_order_strategy"] == "priority"


def test_cli_migrate(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/cli.sqlite3"
    runner = CliRunner()
    for _ in range(2):  # idempotent
        result = runner.invoke(main, ["migrate", "--ledger-url", url])
        assert result.exit_code == 0, result.output
        assert f"version {SCHEMA_VERSION}" in result.output
    engine = create_ledger_engine(url)
    assert "questpie_queue_dispatch" in inspect(engine).get_table_names()
    engine.dispose()
    assert runner.invoke(main, ["migrate"]).exit_code != 0


def test_cli_policy_set_and_show(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `policy set` waits out every process's cached copy; a real worker's test checks it.
    monkeypatch.setattr(recorded_policy, "POLICY_SETTLE_SECONDS", 0.0)
    url = f"sqlite:///{tmp_path}/cli.sqlite3"
    runner = CliRunner()
    assert runner.invoke(main, ["migrate", "--ledger-url", url]).exit_code == 0
    shown = runner.invoke(main, ["policy", "show", "report", "--ledger-url", url])
    assert shown.exit_code == 0, shown.output
    assert "standard" in shown.output
    set_ = runner.invoke(main, ["policy", "set", "report", "stately", "--ledger-url", url])
    assert set_.exit_code == 0, set_.output
    shown = runner.invoke(main, ["policy", "show", "report", "--ledger-url", url])
    assert shown.output.strip() == "report: stately"
    assert runner.invoke(main, ["policy", "set", "report", "fifo", "--ledger-url", url]).exit_code
    ledger = open_ledger(url)
    assert ledger.policies.get("report") is QueuePolicy.STATELY
    ledger.close()


def test_submodules_are_attributes_of_the_package_in_a_fresh_process() -> None:
    """The package imports its names on first use; its submodules too, so
    `questpie_celery.errors.LedgerError` works without importing the submodule first."""
    code = (
        "import questpie_celery\n"
        "assert questpie_celery.errors.LedgerError is questpie_celery.LedgerError\n"
        "assert questpie_celery.ledger.metadata is questpie_celery.metadata\n"
        "try:\n"
        "    questpie_celery.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# --- the Celery task of a job, one attribute away ---------------------------------------


def test_a_jobs_celery_task_is_its_task_attribute() -> None:
    definition = job(name="task-attribute", schema=Empty)(_noop)
    questpie = _questpie(jobs=[definition])
    task = questpie.celery_app.tasks["task-attribute"]
    assert definition.task is task
    assert questpie.queue.task_attribute.task is task
    assert definition.task.s({}).task == "task-attribute"  # Canvas takes it as it is


def test_a_definition_asked_for_a_task_method_says_where_the_task_is() -> None:
    definition = job(name="no-delay-here", schema=Empty)(_noop)
    _questpie(jobs=[definition])
    for method in ("delay", "apply_async", "s", "si", "signature"):
        with pytest.raises(AttributeError) as caught:
            getattr(definition, method)
        message = str(caught.value)
        assert f"_noop.task.{method}(...)" in message
        assert "questpie.queue.no_delay_here.publish(...)" in message
    assert not hasattr(definition, "delay")
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = definition.nothing  # type: ignore[attr-defined]


def test_a_task_plain_call_runs_the_handler_in_eager_mode() -> None:
    seen: list[str] = []

    class Hello(BaseModel):
        name: str

    @job(name="eager-plain-call", schema=Hello)
    def hello(payload: Hello, ctx: JobContext) -> str:
        seen.append(payload.name)
        return payload.name

    questpie = _questpie(jobs=[hello])
    questpie.migrate()
    questpie.celery_app.conf.task_always_eager = True
    assert hello.task.delay({"name": "ada"}).get() == "ada"
    assert hello.task.apply_async(args=[{"name": "bob"}]).get() == "bob"
    assert seen == ["ada", "bob"]


def test_a_declared_job_gets_its_task_from_the_current_app_as_shared_task_does() -> None:
    app = Celery("current", broker="memory://")  # the current app from here on
    _ = Questpie(app, ledger_url="sqlite://")
    declared = job(name="declared-later", schema=Empty)(_noop)
    assert not app.finalized
    assert declared.task is app.tasks["declared-later"]  # finalized: the Questpie adopted it


def test_a_job_without_one_task_says_which_to_use() -> None:
    shared = job(name="on-two-apps", schema=Empty)(_noop)
    _questpie(jobs=[shared])
    _questpie(jobs=[shared])
    with pytest.raises(JobDefinitionError, match=r"questpie\.queue\.on_two_apps\.task"):
        _ = shared.task


def test_a_job_without_one_task_still_looks_like_an_object_without_that_attribute() -> None:
    """No task (or one per app) is also an AttributeError: `hasattr`, `getattr(...,
    default)`, `inspect.getmembers` and `mock.create_autospec` keep working on it."""
    _ = Celery("no-questpie", broker="memory://")  # the current app, with no Questpie
    alone = job(name="task-on-no-app", schema=Empty)(_noop)
    _assert_has_no_task_attribute(alone)
    shared = job(name="task-on-two-apps", schema=Empty)(_noop)
    _questpie(jobs=[shared])
    _questpie(jobs=[shared])
    _assert_has_no_task_attribute(shared)


def _assert_has_no_task_attribute(definition: JobDefinition[Any]) -> None:
    assert not hasattr(definition, "task")
    assert getattr(definition, "task", None) is None
    assert "task" not in dict(inspect_module.getmembers(definition))
    assert callable(mock.create_autospec(definition).validate)
    with pytest.raises(JobDefinitionError, match=r"\.task"):
        _ = definition.task


# --- -A: what celery -A takes, the Questpie, and the two mixed up -----------------------

DJANGO_LIKE = {
    # Celery's own layout for Django: the package imports its app, as the docs say.
    "__init__.py": "from .celery import app as celery_app\n",
    "celery.py": (
        "import os\n"
        "from celery import Celery\n"
        "from questpie_celery import Questpie\n"
        "app = Celery('proj', broker='memory://')\n"
        "questpie = Questpie(app, ledger_url=os.environ['PROJ_LEDGER'])\n"
    ),
}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package with Celery's Django layout, importable under a name of its own."""
    name = f"proj_{os.getpid()}_{len(list(tmp_path.parent.iterdir()))}"
    (tmp_path / name).mkdir()
    for file, body in DJANGO_LIKE.items():
        (tmp_path / name / file).write_text(body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PROJ_LEDGER", f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]


@pytest.mark.parametrize("spec", ["{p}", "{p}.celery", "{p}.celery:app", "{p}.celery:questpie"])
def test_the_cli_takes_what_celery_a_takes_and_the_questpie_itself(project: str, spec: str) -> None:
    result = CliRunner().invoke(main, ["migrate", "-A", spec.format(p=project)])
    assert result.exit_code == 0, result.output
    assert f"version {SCHEMA_VERSION}" in result.output


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("{p}.celery:nothing", "has no attribute 'nothing'"),
        ("{p}.celery:os", "neither a Questpie nor a Celery app"),
        ("{p}_missing", "no module named"),
    ],
)
def test_the_cli_says_what_is_wrong_with_an_app_it_cannot_use(
    project: str, spec: str, says: str
) -> None:
    result = CliRunner().invoke(main, ["migrate", "-A", spec.format(p=project)])
    assert result.exit_code == 2, result.output
    assert says in result.output
    assert isinstance(result.exception, SystemExit)  # no traceback


@pytest.mark.parametrize(
    ("files", "spec"),
    [
        # Celery's search for the app imports proj.celery and forgets why that failed.
        ({"{p}/__init__.py": "", "{p}/celery.py": "import qp_missing_dependency\n"}, "{p}"),
        # The missing module's name begins the project's own.
        ({"{p}_tasks.py": "import {p}\n"}, "{p}_tasks"),
    ],
)
def test_an_import_error_inside_the_project_is_raised_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str], spec: str
) -> None:
    name = f"qpbroken_{os.getpid()}"
    for file, body in files.items():
        path = tmp_path / file.format(p=name)
        path.parent.mkdir(exist_ok=True)
        path.write_text(body.format(p=name))
    monkeypatch.chdir(tmp_path)
    try:
        result = CliRunner().invoke(main, ["migrate", "-A", spec.format(p=name)])
    finally:
        for module in [m for m in sys.modules if m.startswith(name)]:
            del sys.modules[module]
    assert isinstance(result.exception, ModuleNotFoundError), result.output
    assert result.exception.name in ("qp_missing_dependency", name)


def test_celery_given_the_questpie_says_what_to_write(project: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", f"{project}.celery:questpie", "worker"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "Error: celery -A takes your Celery app" in done.stderr
    assert f"write celery -A {project}.celery:app" in done.stderr
