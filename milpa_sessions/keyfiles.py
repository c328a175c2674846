"""Writing an operator key pair to files: the private key and the public key the fold trusts."""

from __future__ import annotations

import os
import re
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from schemas.errors import ConfigurationError
from schemas.secret_files import check_owner_writes
from session_model.signing import Signer

# A key id names its files (`<id>.key`, `trusted/<id>.pem`, whose stem the fold reads back).
KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def write_key_pair(signer: Signer, directory: Path) -> tuple[Path, Path]:
    """Write `<dir>/<key_id>.key` (private, 0600) and `<dir>/trusted/<key_id>.pem` (public).

    Returns the private key's path (MILPA_SIGNING_KEY) and the trusted directory
    (MILPA_TRUSTED_KEYS_DIR). Neither file may exist (`ConfigurationError`): a key is never
    overwritten, and a file is never written through a symbolic link or with wider permissions
    first (the private key is created 0600, exclusively).
    """
    if not KEY_ID.fullmatch(signer.key_id):
        raise ConfigurationError(
            f"{signer.key_id!r} is not a key id: letters, digits, '.', '_' and '-' (up to 128, "
            "the first a letter or digit), since it names the key's files"
        )
    trusted = directory / "trusted"
    try:
        # Not writable by the group or others whatever the umask: the fold refuses such a
        # directory (whoever may add a key there is an operator).
        trusted.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigurationError(f"cannot make the directory {trusted}: {e.strerror}") from e
    check_owner_writes(trusted, "trusted keys directory")
    private = directory / f"{signer.key_id}.key"
    public = trusted / f"{signer.key_id}.pem"
    for path in (private, public):
        if path.exists() or path.is_symlink():
            raise ConfigurationError(
                f"{path} already exists: a key is never overwritten (remove it first, or choose "
                "another key id)"
            )
    _create(
        private,
        signer.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        0o600,
    )
    try:
        _create(
            public,
            signer.private_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
            0o644,
        )
    except ConfigurationError:
        private.unlink(missing_ok=True)  # no half pair left behind to refuse the next attempt
        raise
    return private, trusted


def _create(path: Path, data: bytes, mode: int) -> None:
    """Write a new file with `mode` from its creation; refuse an existing one or a link."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError as e:
        raise ConfigurationError(f"{path} already exists: a key is never overwritten") from e
    except OSError as e:
        raise ConfigurationError(f"cannot write {path}: {e.strerror}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as e:
        path.unlink(missing_ok=True)
        raise ConfigurationError(f"cannot write {path}: {e.strerror}") from e
