"""The Lua scripts load from their files with every placeholder filled from the layout."""

from __future__ import annotations

import hashlib

import pytest

from projections import layout, scripts
from schemas.errors import ConfigurationError


@pytest.mark.parametrize("script", scripts.ALL, ids=lambda s: s.name)
def test_every_placeholder_is_filled_and_the_sha_is_the_sources(script: scripts.Script) -> None:
    assert "@" not in script.source
    assert script.sha == hashlib.sha1(script.source.encode()).hexdigest()


def test_the_bounds_come_from_the_layout() -> None:
    source = scripts.COMMIT.source
    assert f"local H, CHUNK = KEYS[1], {layout.CHUNK}" in source
    assert f"#ids > {layout.IDS_INLINE} then" in source
    assert f"#state <= {layout.STATE_INLINE} then" in source
    assert layout.chunk_names("s", layout.STATE_INLINE) in scripts.READ.source
    assert "header(" not in scripts.DUE.source  # the due script has no header prepended


def test_an_unknown_placeholder_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scripts, "_text", lambda name: "return @NOT_A_BOUND@")
    with pytest.raises(ConfigurationError, match="NOT_A_BOUND"):
        scripts.load("due")
