"""Secrets and trusted keys come from files only their owner may change."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from console.auth import load_users
from milpa_sessions.keyfiles import write_key_pair
from milpa_sessions.settings import Settings
from milpa_sessions.wiring import trusted_keys
from schemas.errors import ConfigurationError
from schemas.secret_files import check_owner_writes, read_secret
from session_model.signing import Signer, TrustedKeys


def _file(tmp_path: Path, mode: int, data: bytes = b"s3cret") -> Path:
    path = tmp_path / "secret"
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_a_secret_only_its_owner_reads_is_read_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert read_secret(_file(tmp_path, 0o600), "secret") == b"s3cret"
    assert caplog.records == []


def test_a_secret_others_may_read_is_read_with_a_warning_that_never_shows_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert read_secret(_file(tmp_path, 0o644), "secret") == b"s3cret"
    assert "readable by others" in caplog.text and "s3cret" not in caplog.text


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_a_secret_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(ConfigurationError, match="writable by others"):
        read_secret(_file(tmp_path, mode), "secret")


def test_a_missing_secret_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot read the secret"):
        read_secret(tmp_path / "missing", "secret")


def test_a_trusted_key_others_may_write_is_refused(tmp_path: Path) -> None:
    _, trusted = write_key_pair(Signer.generate("ops-1"), tmp_path)
    pem = trusted / "ops-1.pem"
    assert TrustedKeys.from_pem_files([pem]).key_ids() == ("ops-1",)
    pem.chmod(0o666)
    with pytest.raises(ConfigurationError, match=r"trusted key .* writable by others"):
        TrustedKeys.from_pem_files([pem])


def test_a_trusted_keys_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    _, trusted = write_key_pair(Signer.generate("ops-1"), tmp_path)
    settings = Settings(trusted_keys_dir=trusted)
    assert trusted_keys(settings).key_ids() == ("ops-1",)
    trusted.chmod(0o777)
    with pytest.raises(ConfigurationError, match=r"trusted keys directory .* writable by others"):
        trusted_keys(settings)
    check_owner_writes(tmp_path, "directory")  # its parent, 0700 from pytest: fine


def test_an_operators_file_others_may_write_is_refused(tmp_path: Path) -> None:
    users = _file(tmp_path, 0o646, b"alice:$argon2id$v=19$m=65536,t=3,p=4$c2FsdA$aGFzaA\n")
    with pytest.raises(ConfigurationError, match=r"users file .* writable by others"):
        load_users(users)
