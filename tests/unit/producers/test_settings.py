"""Settings: the fold's authority inputs read from MILPA_* with clear errors."""

from __future__ import annotations

import pytest

from producers.settings import StackSettings
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
