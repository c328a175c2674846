"""Settings: the fold's authority inputs read from MILPA_* with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from producers.settings import StackSettings, WriterSettings
from schemas.errors import ConfigurationError
from session_model.modes import Mode


def test_the_unsigned_start_mode_and_the_cutover_are_read_from_the_environment() -> None:
    env = {"MILPA_UNSIGNED_START_MODE": "acknowledge", "MILPA_AUTHORITY_CUTOVER": "0:5, 2:9"}
    settings = StackSettings.from_env(env)
    assert settings.start_mode() is Mode.ACKNOWLEDGE
    assert settings.cutover().before == {0: 5, 2: 9}
    defaults = StackSettings()
    assert (defaults.start_mode(), defaults.cutover().before) == (Mode.ASK, {})


@pytest.mark.parametrize(
    ("field", "value", "variable"),
    [
        ("unsigned_start_mode", "yolo", "MILPA_UNSIGNED_START_MODE"),
        ("authority_cutover", "0-5", "MILPA_AUTHORITY_CUTOVER"),
        ("authority_cutover", "a:1", "MILPA_AUTHORITY_CUTOVER"),
    ],
)
def test_a_bad_authority_setting_is_a_configuration_error_naming_it(
    field: str, value: str, variable: str
) -> None:
    settings = StackSettings(**{field: value})
    with pytest.raises(ConfigurationError, match=variable):
        settings.start_mode() if field == "unsigned_start_mode" else settings.cutover()


def test_the_id_key_is_read_from_its_file_and_a_short_one_is_refused(tmp_path: Path) -> None:
    assert WriterSettings().id_key() is None
    path = tmp_path / "id.key"
    path.write_bytes(b"k" * 32 + b"\n")
    path.chmod(0o600)
    assert WriterSettings.from_env({"MILPA_ID_KEY_FILE": str(path)}).id_key() == b"k" * 32
    path.write_bytes(b"short\n")
    with pytest.raises(ConfigurationError, match=r"MILPA_ID_KEY_FILE.*shorter than 16 bytes"):
        WriterSettings(id_key_file=path).id_key()
    with pytest.raises(ConfigurationError, match="cannot read"):
        WriterSettings(id_key_file=tmp_path / "absent").id_key()
