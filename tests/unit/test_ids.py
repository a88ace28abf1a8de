import uuid

from questpie_celery import derive_dispatch_id
from questpie_celery.jobs.ids import random_dispatch_id


def test_spec_test_vector() -> None:
    assert derive_dispatch_id("notify", "notify:one") == "bb53f86e-b51d-5b64-9513-ae9aa2ba1936"


def test_derived_id_is_a_version_5_rfc4122_uuid() -> None:
    value = uuid.UUID(derive_dispatch_id("send-welcome-email", "welcome:usr_123"))
    assert value.version == 5
    assert value.variant == uuid.RFC_4122


def test_id_depends_on_job_and_key_and_is_unambiguous() -> None:
    assert derive_dispatch_id("a", "b") == derive_dispatch_id("a", "b")
    assert derive_dispatch_id("a", "b") != derive_dispatch_id("b", "a")
    # The NUL separator keeps ("ab", "c") and ("a", "bc") apart.
    assert derive_dispatch_id("ab", "c") != derive_dispatch_id("a", "bc")


def test_non_ascii_keys_hash_their_utf8_bytes() -> None:
    assert derive_dispatch_id("notify", "žluťoučký") != derive_dispatch_id("notify", "zlutoucky")


def test_random_ids_are_uuid4() -> None:
    assert uuid.UUID(random_dispatch_id()).version == 4
    assert random_dispatch_id() != random_dispatch_id()
