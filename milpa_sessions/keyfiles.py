"""Writing an operator key pair to files: the private key and the public key the fold trusts."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization

from session_model.signing import Signer


def write_key_pair(signer: Signer, directory: Path) -> tuple[Path, Path]:
    """Write `<dir>/<key_id>.key` (private, 0600) and `<dir>/trusted/<key_id>.pem` (public).

    Returns the private key's path (MILPA_SIGNING_KEY) and the trusted directory
    (MILPA_TRUSTED_KEYS_DIR).
    """
    trusted = directory / "trusted"
    trusted.mkdir(parents=True, exist_ok=True)
    private = directory / f"{signer.key_id}.key"
    private.touch(mode=0o600)
    private.write_bytes(
        signer.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    private.chmod(0o600)
    (trusted / f"{signer.key_id}.pem").write_bytes(
        signer.private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, trusted
