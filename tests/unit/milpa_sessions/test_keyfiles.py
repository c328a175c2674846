"""`keys generate` writes a key pair once: never over an existing key, never through a link."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from milpa_sessions import keyfiles
from milpa_sessions.keyfiles import write_key_pair
from schemas.errors import ConfigurationError
from session_model.signing import Signer, TrustedKeys


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


@pytest.mark.parametrize("umask", [0o002, 0o000])
def test_the_trusted_directory_is_one_the_fold_accepts_whatever_the_umask(
    tmp_path: Path, umask: int
) -> None:
    signer = Signer.generate("ops-1")
    old = os.umask(umask)
    try:
        _, trusted = write_key_pair(signer, tmp_path / "keys")
    finally:
        os.umask(old)
    assert not stat.S_IMODE(trusted.stat().st_mode) & (stat.S_IWGRP | stat.S_IWOTH)
    assert TrustedKeys.from_pem_files(trusted.glob("*.pem")) == signer.trusted_keys()


def test_an_existing_trusted_directory_others_may_write_is_refused_before_any_key(
    tmp_path: Path,
) -> None:
    (tmp_path / "trusted").mkdir()
    (tmp_path / "trusted").chmod(0o777)
    with pytest.raises(ConfigurationError, match="writable by others"):
        write_key_pair(Signer.generate("ops-1"), tmp_path)
    assert not (tmp_path / "ops-1.key").exists()


@pytest.mark.parametrize("key_id", ["../escape", "a/b", ".hidden", "", "x" * 129])
def test_a_key_id_that_cannot_name_its_files_is_refused(tmp_path: Path, key_id: str) -> None:
    with pytest.raises(ConfigurationError, match="is not a key id"):
        write_key_pair(Signer.generate(key_id), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_directory_it_cannot_write_is_a_configuration_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigurationError, match="cannot make the directory"):
        write_key_pair(Signer.generate("ops-1"), blocker)


def test_a_failed_public_key_leaves_no_private_key_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    real = keyfiles._create

    def refuse_public(path: Path, data: bytes, mode: int) -> None:
        if path.suffix == ".pem":
            raise ConfigurationError(f"cannot write {path}: disk full")
        real(path, data, mode)

    monkeypatch.setattr(keyfiles, "_create", refuse_public)
    with pytest.raises(ConfigurationError, match="disk full"):
        write_key_pair(Signer.generate("ops-1"), tmp_path)
    assert not (tmp_path / "ops-1.key").exists()
