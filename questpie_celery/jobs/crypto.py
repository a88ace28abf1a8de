"""Envelope encryption of secret payloads.

Each secret dispatch gets a fresh random 256-bit data key. The JSON payload is
encrypted with it under AES-256-GCM; the data key is wrapped, also with
AES-256-GCM, under a key derived by HKDF-SHA-256 from the app secret with the
dispatch id in `info`. Associated data binds each ciphertext to its purpose, job
name and dispatch id, so nothing can be swapped between rows or between the two
ciphertexts of one row. Each wrapped key records which secret wrapped it by a
fingerprint (an HKDF output, which reveals nothing about the secret), so workers
holding `previous_secrets` can still open work wrapped before a rotation.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import SecretDecryptionError

MIN_SECRET_BYTES = 32
_NONCE_BYTES = 12
_PAYLOAD_PURPOSE = b"questpie-secret-payload-v1"
_WRAP_PURPOSE = b"questpie-secret-wrap-v1"
_FINGERPRINT_INFO = b"questpie-secret-fingerprint-v1"


@dataclass(frozen=True)
class Sealed:
    """What the ledger stores for a secret payload."""

    ciphertext: bytes  # nonce || AES-GCM(data key, payload JSON)
    wrapped_key: bytes  # nonce || AES-GCM(wrapping key, data key)
    key_id: str  # fingerprint of the secret that wrapped the data key


def fingerprint(secret: bytes) -> str:
    return _hkdf(secret, _FINGERPRINT_INFO, 16).hex()


class Keyring:
    """The current secret, which seals new work, and older ones, which only open."""

    def __init__(self, current: bytes, previous: tuple[bytes, ...] = ()) -> None:
        self.current = current
        self._by_id = {fingerprint(s): s for s in (*previous, current)}
        self.current_id = fingerprint(current)

    def seal(self, payload: dict[str, Any], *, job_name: str, dispatch_id: str) -> Sealed:
        data_key = AESGCM.generate_key(bit_length=256)
        plaintext = json.dumps(payload, separators=(",", ":")).encode()
        ciphertext = _encrypt(data_key, plaintext, _aad(_PAYLOAD_PURPOSE, job_name, dispatch_id))
        wrapping_key = _wrapping_key(self.current, dispatch_id)
        wrapped = _encrypt(wrapping_key, data_key, _aad(_WRAP_PURPOSE, job_name, dispatch_id))
        return Sealed(ciphertext=ciphertext, wrapped_key=wrapped, key_id=self.current_id)

    def open(self, sealed: Sealed, *, job_name: str, dispatch_id: str) -> dict[str, Any]:
        """Unwrap and decrypt; any tampering, a wrong or missing secret raises.

        The error says which step failed and never carries plaintext or a cause.
        """
        secret = self._by_id.get(sealed.key_id)
        if secret is None:
            raise SecretDecryptionError(
                "no configured secret matches the one that wrapped this payload "
                "(was it rotated without previous_secrets?)",
                retryable=True,
            )
        try:
            data_key = _decrypt(
                _wrapping_key(secret, dispatch_id),
                sealed.wrapped_key,
                _aad(_WRAP_PURPOSE, job_name, dispatch_id),
            )
            plaintext = _decrypt(
                data_key, sealed.ciphertext, _aad(_PAYLOAD_PURPOSE, job_name, dispatch_id)
            )
        except (InvalidTag, ValueError):
            raise SecretDecryptionError(
                "the secret payload failed authentication: tampered, swapped, or wrong key"
            ) from None
        value = json.loads(plaintext)
        if not isinstance(value, dict):
            raise SecretDecryptionError("the secret payload is not a JSON object")
        return value


def _hkdf(secret: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def _wrapping_key(secret: bytes, dispatch_id: str) -> bytes:
    return _hkdf(secret, _WRAP_PURPOSE + b"\0" + dispatch_id.encode(), 32)


def _aad(purpose: bytes, job_name: str, dispatch_id: str) -> bytes:
    return purpose + b"\0" + job_name.encode() + b"\0" + dispatch_id.encode()


def _encrypt(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    nonce = os.urandom(_NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def _decrypt(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    if len(sealed) <= _NONCE_BYTES:
        raise ValueError("truncated")
    return AESGCM(key).decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], aad)
