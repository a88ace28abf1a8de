"""The envelope encryption on its own (the worker-side behaviour is in test_secrets)."""

from __future__ import annotations

import pytest

from questpie_celery.errors import QuestpieError, SecretDecryptionError
from questpie_celery.jobs.crypto import Keyring, Sealed, fingerprint

CURRENT = b"c" * 32
OLD = b"o" * 40
PAYLOAD = {"link": "https://example.test/one-time/CANARY"}


def test_round_trip_and_fresh_keys_each_time() -> None:
    ring = Keyring(CURRENT)
    first = ring.seal(PAYLOAD, job_name="j", dispatch_id="d1")
    second = ring.seal(PAYLOAD, job_name="j", dispatch_id="d1")
    assert first.ciphertext != second.ciphertext  # fresh data key and nonce
    assert first.wrapped_key != second.wrapped_key
    assert b"CANARY" not in first.ciphertext + first.wrapped_key
    assert ring.open(first, job_name="j", dispatch_id="d1") == PAYLOAD


@pytest.mark.parametrize(
    ("job_name", "dispatch_id"), [("other-job", "d1"), ("j", "d2")], ids=["job", "dispatch"]
)
def test_associated_data_binds_job_and_dispatch(job_name: str, dispatch_id: str) -> None:
    ring = Keyring(CURRENT)
    sealed = ring.seal(PAYLOAD, job_name="j", dispatch_id="d1")
    with pytest.raises(SecretDecryptionError):
        ring.open(sealed, job_name=job_name, dispatch_id=dispatch_id)


def test_tampering_with_either_part_is_detected() -> None:
    ring = Keyring(CURRENT)
    sealed = ring.seal(PAYLOAD, job_name="j", dispatch_id="d1")
    for broken in (
        Sealed(sealed.ciphertext[:-1] + bytes([sealed.ciphertext[-1] ^ 1]), sealed.wrapped_key,
               sealed.key_id),
        Sealed(sealed.ciphertext, sealed.wrapped_key[:-1] + bytes([sealed.wrapped_key[-1] ^ 1]),
               sealed.key_id),
        Sealed(sealed.ciphertext[:5], sealed.wrapped_key, sealed.key_id),
        # The two ciphertexts of a row cannot stand in for each other either.
        Sealed(sealed.wrapped_key, sealed.ciphertext, sealed.key_id),
    ):  # fmt: skip
        with pytest.raises(SecretDecryptionError) as caught:
            ring.open(broken, job_name="j", dispatch_id="d1")
        assert caught.value.__cause__ is None
        assert isinstance(caught.value, QuestpieError)


def test_rotation_opens_old_work_and_seals_with_the_new_secret() -> None:
    sealed_by_old = Keyring(OLD).seal(PAYLOAD, job_name="j", dispatch_id="d1")
    rotated = Keyring(CURRENT, previous=(OLD,))
    assert rotated.open(sealed_by_old, job_name="j", dispatch_id="d1") == PAYLOAD
    assert rotated.seal(PAYLOAD, job_name="j", dispatch_id="d2").key_id == fingerprint(CURRENT)
    with pytest.raises(SecretDecryptionError, match="previous_secrets"):
        Keyring(CURRENT).open(sealed_by_old, job_name="j", dispatch_id="d1")


def test_fingerprint_is_stable_distinct_and_not_the_secret() -> None:
    assert fingerprint(CURRENT) == fingerprint(CURRENT)
    assert fingerprint(CURRENT) != fingerprint(OLD)
    assert CURRENT.hex() not in fingerprint(CURRENT)
    assert len(fingerprint(CURRENT)) == 32
