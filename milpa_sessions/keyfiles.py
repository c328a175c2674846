"""Writing an operator key pair to files: the private key and the public key the fold trusts."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from schemas.errors import ConfigurationError
from session_model.signing import Signer


def write_key_pair(signer: Signer, directory: Path) -> tuple[Path, Path]:
    """Write `<dir>/<key_id>.key` (private, 0600) and `<dir>/trusted/<key_id>.pem` (public).

    Returns the private key's path (MILPA_SIGNING_KEY) and the trusted directory
    (MILPA_TRUSTED_KEYS_DIR). Neither file may exist (`ConfigurationError`): a key is never
    overwritten, and a file is never written through a symbolic link or with wider permissions
    first (the private key is created 0600, exclusively).
    """
    trusted = directory / "trusted"
    trusted.mkdir(parents=True, exist_ok=True)
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
    _create(
        public,
        signer.private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
        0o644,
    )
    return private, trusted


def _create(path: Path, data: bytes, mode: int) -> None:
    """Write a new file with `mode` from its creation; refuse an existing one or a link."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError as e:
        raise ConfigurationError(f"{path} already exists: a key is never overwritten") from e
    with os.fdopen(fd, "wb") as f:
        f.write(data)
