"""`keys generate` writes a key pair once: never over an existing key, never through a link."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from milpa_sessions.keyfiles import write_key_pair
from schemas.errors import ConfigurationError
from session_model.signing import Signer


def test_the_private_key_is_0600_from_its_creation_and_both_files_read_back(
    tmp_path: Path,
) -> None:
    signer = Signer.generate("ops-1")
    old = os.umask(0)  # nothing masks what the file is created with
    try:
        private, trusted = write_key_pair(signer, tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert Signer.from_pem_file(private, "ops-1").trusted_keys() == signer.trusted_keys()
    assert (trusted / "ops-1.pem").read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")


def test_an_existing_key_is_never_overwritten(tmp_path: Path) -> None:
    private, _ = write_key_pair(Signer.generate("ops-1"), tmp_path)
    before = private.read_bytes()
    with pytest.raises(ConfigurationError, match="already exists"):
        write_key_pair(Signer.generate("ops-1"), tmp_path)
    assert private.read_bytes() == before


def test_a_link_where_the_private_key_goes_is_refused_and_its_target_untouched(
    tmp_path: Path,
) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not a key")
    (tmp_path / "ops-1.key").symlink_to(target)
    with pytest.raises(ConfigurationError, match="already exists"):
        write_key_pair(Signer.generate("ops-1"), tmp_path)
    assert target.read_bytes() == b"not a key"
    (tmp_path / "dangling.key").symlink_to(tmp_path / "missing")
    with pytest.raises(ConfigurationError, match="already exists"):
        write_key_pair(Signer.generate("dangling"), tmp_path)
    assert not (tmp_path / "missing").exists()
