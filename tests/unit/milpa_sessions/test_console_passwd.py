"""`console passwd` writes the users file, and says so in one line when it cannot."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from milpa_sessions.cli import main

ENV = {"MILPA_KAFKA_BOOTSTRAP": "127.0.0.1:1", "MILPA_REDIS_URL": "redis://127.0.0.1:1/0"}


def test_a_users_file_it_cannot_write_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the users file's directory should be")
    users = blocker / "users"
    result = CliRunner().invoke(
        main, ["console", "passwd", "ops", "--file", str(users), "--password", "pw-1"], env=ENV
    )
    assert result.exit_code != 0
    assert f"cannot write the users file {users}" in result.output
    assert "Traceback" not in result.output
    assert not isinstance(result.exception, OSError)


def test_an_operator_is_added_with_a_hash_readable_by_the_owner_only(tmp_path: Path) -> None:
    users = tmp_path / "users"
    result = CliRunner().invoke(
        main, ["console", "passwd", "ops", "--file", str(users), "--password", "pw-1"], env=ENV
    )
    assert result.exit_code == 0, result.output
    (line,) = users.read_text().splitlines()
    assert line.startswith("ops:$argon2id$")
    assert users.stat().st_mode & 0o077 == 0
