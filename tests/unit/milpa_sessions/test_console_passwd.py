"""`console passwd` writes the users file, and says so in one line when it cannot."""

from __future__ import annotations

from pathlib import Path

from argon2 import PasswordHasher
from click.testing import CliRunner

from milpa_sessions.cli import main

ENV = {"MILPA_KAFKA_BOOTSTRAP": "127.0.0.1:1", "MILPA_REDIS_URL": "redis://127.0.0.1:1/0"}


def _passwd(users: Path, *args: str, stdin: str) -> object:
    return CliRunner().invoke(
        main, ["console", "passwd", "ops", "--file", str(users), *args], input=stdin, env=ENV
    )


def _signs_in(users: Path, name: str, password: str) -> bool:
    (line,) = (x for x in users.read_text().splitlines() if x.startswith(f"{name}:"))
    return PasswordHasher().verify(line.split(":", 1)[1], password)


def test_a_users_file_it_cannot_write_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the users file's directory should be")
    users = blocker / "users"
    result = _passwd(users, "--password-stdin", stdin="pw-1\n")
    assert result.exit_code != 0
    assert f"cannot write the users file {users}" in result.output
    assert "Traceback" not in result.output
    assert not isinstance(result.exception, OSError)


def test_an_operator_is_added_with_a_hash_readable_by_the_owner_only(tmp_path: Path) -> None:
    users = tmp_path / "users"
    result = _passwd(users, "--password-stdin", stdin="pw-1\n")
    assert result.exit_code == 0, result.output
    (line,) = users.read_text().splitlines()
    assert line.startswith("ops:$argon2id$")
    assert _signs_in(users, "ops", "pw-1")
    assert users.stat().st_mode & 0o077 == 0


def test_the_password_is_asked_twice_without_echo_when_not_piped(tmp_path: Path) -> None:
    users = tmp_path / "users"
    result = _passwd(users, stdin="pw-2\npw-2\n")
    assert result.exit_code == 0, result.output
    assert "pw-2" not in result.output
    assert _signs_in(users, "ops", "pw-2")


def test_the_password_is_never_an_argument(tmp_path: Path) -> None:
    # A command line is readable by every user of the machine (ps, /proc) and kept in histories.
    users = tmp_path / "users"
    result = _passwd(users, "--password", "pw-1", stdin="")
    assert result.exit_code == 2
    assert "No such option: --password" in result.output
    assert not users.exists()


def test_an_empty_stdin_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    users = tmp_path / "users"
    result = _passwd(users, "--password-stdin", stdin="\n")
    assert result.exit_code == 2
    assert "stdin holds no password" in result.output
    assert not users.exists()
