"""Ed25519 signatures: over one call (the signature gate) and over one answer (verified humans).

The trusted public keys are an explicit input, like the fold's code: the same key set gives the same
replay; removing a compromised key and rebuilding re-reads its signatures as unverified.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from schemas.errors import SignatureError
from schemas.secret_files import check_owner_writes, read_secret
from session_model.canonical import canonical_bytes


def answer_signing_bytes(
    *,
    key_id: str,
    session_id: str,
    question_id: str,
    answer: str,
    principal_id: str,
    event_id: str,
    asked_seq: int | None = None,
) -> bytes:
    """The bytes an answering key signs: they name one answer by one principal in one event.

    With `asked_seq`, also the asking answered: the field is then part of the signed bytes, so an
    answer's record cannot be moved to another asking of the same question id (or stripped of
    its binding) without losing its signature.
    """
    fields: dict[str, object] = {
        "kind": "milpa.answer.v1",
        "key_id": key_id,
        "session_id": session_id,
        "question_id": question_id,
        "answer": answer,
        "principal_id": principal_id,
        "event_id": event_id,
    }
    if asked_seq is not None:
        fields["asked_seq"] = asked_seq
    return canonical_bytes(fields)


def authority_signing_bytes(
    *,
    key_id: str,
    session_id: str,
    event_id: str,
    event_type: str,
    fields: Mapping[str, object],
) -> bytes:
    """The bytes an operator key signs to raise a session's authority: one event, its fields."""
    return canonical_bytes(
        {
            "kind": "milpa.authority.v1",
            "key_id": key_id,
            "session_id": session_id,
            "event_id": event_id,
            "type": event_type,
            "fields": dict(fields),
        }
    )


def call_signing_bytes(
    *, session_id: str, operation: str, argument_digest: str, question_seq: int | None = None
) -> bytes:
    """The bytes a signature over one call covers: this session, this operation, these arguments.

    With `question_seq`, also the asking it answers: Ed25519 signatures are deterministic, so
    without it a second approval of the same call would repeat the first one's bytes exactly and
    could not be told from a replay.
    """
    fields: dict[str, object] = {
        "kind": "milpa.call.v1",
        "session_id": session_id,
        "operation": operation,
        "argument_digest": argument_digest,
    }
    if question_seq is not None:
        fields["question_seq"] = question_seq
    return canonical_bytes(fields)


@dataclass(frozen=True, slots=True)
class TrustedKeys:
    """Public keys (by key id) whose signatures the fold and the signature gate believe.

    Verification goes through libsodium (PyNaCl): on the bench machine it verifies an Ed25519
    signature in 54 µs where OpenSSL (`cryptography`) takes 104, and the fold verifies every
    grant, relaxed mode and approval it applies. `cryptography` still loads and makes keys.
    """

    keys: Mapping[str, Ed25519PublicKey] = field(default_factory=dict)
    _verifiers: Mapping[str, VerifyKey] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        raw = {
            key_id: key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            for key_id, key in self.keys.items()
        }
        object.__setattr__(self, "_verifiers", {k: VerifyKey(v) for k, v in raw.items()})

    @classmethod
    def none(cls) -> TrustedKeys:
        """A key set that trusts nobody: every verified claim is downgraded."""
        return cls({})

    @classmethod
    def from_raw(cls, raw: Mapping[str, bytes]) -> TrustedKeys:
        """Build from 32-byte raw Ed25519 public keys by key id."""
        try:
            return cls({k: Ed25519PublicKey.from_public_bytes(v) for k, v in raw.items()})
        except ValueError as e:
            raise SignatureError(f"not a raw Ed25519 public key: {e}") from e

    @classmethod
    def from_pem_files(cls, paths: Iterable[Path]) -> TrustedKeys:
        """Load PEM public keys; each file's stem is its key id."""
        keys: dict[str, Ed25519PublicKey] = {}
        for path in paths:
            check_owner_writes(path, "trusted key")  # whoever writes one is an operator
            try:
                key = serialization.load_pem_public_key(path.read_bytes())
            except (OSError, ValueError) as e:
                raise SignatureError(f"cannot load public key {path}: {e}") from e
            if not isinstance(key, Ed25519PublicKey):
                raise SignatureError(f"{path} is not an Ed25519 public key")
            keys[path.stem] = key
        return cls(keys)

    def key_ids(self) -> tuple[str, ...]:
        """The trusted key ids, sorted."""
        return tuple(sorted(self.keys))

    def verify(self, key_id: str, signature: bytes, message: bytes) -> bool:
        """True only if `key_id` is trusted and its key signed exactly `message`."""
        key = self._verifiers.get(key_id)
        if key is None:
            return False
        try:
            key.verify(message, signature)
        except (BadSignatureError, ValueError, TypeError):  # forged, or not a signature at all
            return False
        return True


@dataclass(frozen=True, slots=True)
class Signer:
    """A private Ed25519 key held outside any session (an answering surface or a call approver)."""

    key_id: str
    private_key: Ed25519PrivateKey = field(repr=False)

    @classmethod
    def generate(cls, key_id: str) -> Signer:
        """A fresh key pair (for tests and `keys generate`)."""
        return cls(key_id, Ed25519PrivateKey.generate())

    @classmethod
    def from_pem_file(cls, path: Path, key_id: str | None = None) -> Signer:
        """Load a PEM private key; the key id defaults to the file's stem."""
        data = read_secret(path, "private key")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise SignatureError(f"cannot load private key {path}: {e}") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise SignatureError(f"{path} is not an Ed25519 private key")
        return cls(key_id or path.stem, key)

    def public_raw(self) -> bytes:
        """The raw 32-byte public key."""
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def trusted_keys(self) -> TrustedKeys:
        """A key set trusting only this signer."""
        return TrustedKeys({self.key_id: self.private_key.public_key()})

    def sign_answer(
        self,
        *,
        session_id: str,
        question_id: str,
        answer: str,
        principal_id: str,
        event_id: str,
        asked_seq: int | None = None,
    ) -> dict[str, object]:
        """The `signature` field of a `question_answered` payload (answering the asking at
        `asked_seq`, when given)."""
        message = answer_signing_bytes(
            key_id=self.key_id,
            session_id=session_id,
            question_id=question_id,
            answer=answer,
            principal_id=principal_id,
            event_id=event_id,
            asked_seq=asked_seq,
        )
        return {"key_id": self.key_id, "signature": self.private_key.sign(message)}

    def sign_authority(
        self, *, session_id: str, event_id: str, event_type: str, fields: Mapping[str, object]
    ) -> dict[str, object]:
        """The `authority` field of an event that makes a session less supervised."""
        message = authority_signing_bytes(
            key_id=self.key_id,
            session_id=session_id,
            event_id=event_id,
            event_type=event_type,
            fields=fields,
        )
        return {"key_id": self.key_id, "signature": self.private_key.sign(message)}

    def sign_call(
        self,
        *,
        session_id: str,
        operation: str,
        argument_digest: str,
        question_seq: int | None = None,
    ) -> CallSignature:
        """A signature naming one call (answering the question asked at `question_seq`)."""
        message = call_signing_bytes(
            session_id=session_id,
            operation=operation,
            argument_digest=argument_digest,
            question_seq=question_seq,
        )
        return CallSignature(self.key_id, self.private_key.sign(message))


@dataclass(frozen=True, slots=True)
class CallSignature:
    """A signature over one call, with the id of the key that made it."""

    key_id: str
    signature: bytes

    def encoded(self) -> str:
        """`<key_id>:<base64 signature>`, for passing on a command line or header."""
        return f"{self.key_id}:{base64.b64encode(self.signature).decode('ascii')}"

    @classmethod
    def decode(cls, text: str) -> CallSignature:
        """Parse `encoded()` output."""
        key_id, sep, b64 = text.partition(":")
        if not sep or not key_id:
            raise SignatureError("a call signature reads <key_id>:<base64>")
        try:
            return cls(key_id, base64.b64decode(b64, validate=True))
        except ValueError as e:
            raise SignatureError(f"call signature is not base64: {e}") from e


def verify_answer_claim(
    keys: TrustedKeys,
    signature: object,
    *,
    session_id: str,
    question_id: str,
    answer: str,
    principal_id: str,
    event_id: str,
    asked_seq: int | None = None,
) -> bool:
    """True only if `signature` is a trusted key's signature of exactly this answer."""
    return _verify_record(
        keys,
        signature,
        lambda key_id: answer_signing_bytes(
            key_id=key_id,
            session_id=session_id,
            question_id=question_id,
            answer=answer,
            principal_id=principal_id,
            event_id=event_id,
            asked_seq=asked_seq,
        ),
    )


def verify_authority(
    keys: TrustedKeys,
    signature: object,
    *,
    session_id: str,
    event_id: str,
    event_type: str,
    fields: Mapping[str, object],
) -> bool:
    """True only if `signature` is a trusted key's signature of exactly this authority event."""
    return _verify_record(
        keys,
        signature,
        lambda key_id: authority_signing_bytes(
            key_id=key_id,
            session_id=session_id,
            event_id=event_id,
            event_type=event_type,
            fields=fields,
        ),
    )


def _verify_record(
    keys: TrustedKeys, signature: object, message_for: Callable[[str], bytes]
) -> bool:
    """Whether `signature`, a `{key_id, signature}` record, is its trusted key's signature of
    `message_for(key_id)` (the key id is part of what is signed)."""
    if not isinstance(signature, Mapping):
        return False
    key_id = signature.get("key_id")
    raw = signature.get("signature")
    if not isinstance(key_id, str) or not isinstance(raw, bytes | bytearray):
        return False
    return keys.verify(key_id, bytes(raw), message_for(key_id))


def verify_call(
    keys: TrustedKeys,
    signature: CallSignature | None,
    *,
    session_id: str,
    operation: str,
    argument_digest: str,
    question_seq: int | None = None,
) -> bool:
    """The signature gate: True only for a trusted key's signature over exactly this call."""
    if signature is None:
        return False
    message = call_signing_bytes(
        session_id=session_id,
        operation=operation,
        argument_digest=argument_digest,
        question_seq=question_seq,
    )
    return keys.verify(signature.key_id, signature.signature, message)
