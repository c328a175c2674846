"""The console's settings from `MILPA_*`, and the overview's chart geometry."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from console.app import path_segment, visible
from console.charts import HEIGHT, pauses_chart, tta_chart
from console.settings import WebConsoleSettings
from schemas.errors import ConfigurationError


def test_settings_read_their_types_from_the_environment() -> None:
    s = WebConsoleSettings.from_env(
        {
            "MILPA_CONSOLE_HOST": "0.0.0.0",
            "MILPA_CONSOLE_PORT": "9000",
            "MILPA_CONSOLE_USERS_FILE": "/etc/milpa/users",
            "MILPA_CONSOLE_COOKIE_SECURE": "true",
            "MILPA_CONSOLE_SESSION_HOURS": "1.5",
            "MILPA_SIGNING_KEY": "/keys/ops.key",
        }
    )
    assert (s.console_host, s.console_port) == ("0.0.0.0", 9000)
    assert s.console_users_file == Path("/etc/milpa/users")
    assert s.console_tokens_file is None and s.console_secret_file is None
    assert s.console_cookie_secure is True and s.console_session_hours == 1.5
    assert s.signing_key == Path("/keys/ops.key")  # the writer's settings, inherited
    defaults = WebConsoleSettings()
    assert (defaults.console_host, defaults.console_port) == ("127.0.0.1", 8780)
    assert defaults.console_session_hours == 12 and defaults.console_cookie_secure is False
    with pytest.raises(ConfigurationError, match="MILPA_CONSOLE_PORT"):
        WebConsoleSettings.from_env({"MILPA_CONSOLE_PORT": "eighty"})


def test_the_pauses_chart_stacks_reasons_per_hour_over_the_last_day() -> None:
    now = datetime(2026, 3, 1, 10, 30, tzinfo=UTC)
    hour = now.replace(minute=0)
    rows = [
        {"hour": hour.isoformat(), "reason": "permission", "count": 2},
        {"hour": hour.isoformat(), "reason": "signature", "count": 2},
        {"hour": (hour - timedelta(hours=5)).isoformat(), "reason": "permission", "count": 1},
        {"hour": (hour - timedelta(hours=30)).isoformat(), "reason": "permission", "count": 9},
    ]
    chart = pauses_chart(rows, now)
    assert chart.total == 5  # the hour outside the last 24 is not drawn
    assert [b.css for b in chart.bars] == ["c0", "c0", "c1"]
    old, perm, sig = chart.bars
    assert perm.height == sig.height == 2 * old.height  # the tallest column fills the plot
    assert sig.y + sig.height == perm.y  # stacked
    assert perm.y + perm.height == chart.baseline == HEIGHT - 28
    assert perm.x > old.x
    assert chart.legend == (("c0", "permission"), ("c1", "signature"))
    assert [label.text for label in chart.labels][:2] == ["11", "14"]  # every third hour


def test_the_tta_chart_has_every_bucket_and_an_empty_chart_says_so() -> None:
    rows = [
        {"reason": "permission", "bucket": "le_60s", "count": 3},
        {"reason": "style", "bucket": "gt_86400s", "count": 1},
    ]
    chart = tta_chart(rows)
    texts = [label.text for label in chart.labels]
    assert texts[:10] == ["≤1s", "≤5s", "≤30s", "≤1m", "≤5m", "≤30m", "≤1h", "≤6h", "≤1d", "more"]
    assert [b.title for b in chart.bars] == [
        "≤1m: 3 answers (permission)",
        "more: 1 answer (style)",
    ]
    assert tta_chart([]).empty


def test_a_shared_palette_gives_a_reason_one_colour_in_both_charts() -> None:
    palette = {"permission": "c0", "signature": "c1", "style": "c2"}
    tta = tta_chart([{"reason": "style", "bucket": "le_1s", "count": 1}], palette=palette)
    assert [b.css for b in tta.bars] == ["c2"]
    assert tta.legend == (("c2", "style"),)


def test_a_session_id_in_a_link_is_one_path_segment() -> None:
    """Jinja's `urlencode` keeps `/`: `x/../victim` would have linked to session `victim`."""
    assert path_segment("x/../victim") == "x%2F..%2Fvictim"
    assert path_segment("s 1?a#b") == "s%201%3Fa%23b"


def test_what_an_operator_signs_shows_its_invisible_characters() -> None:
    """A right-to-left override shows `{"path":"/srv/exe.png"}` for `.../gnp.exe`."""
    assert visible('{"path":"/srv/\u202egnp.exe"}') == '{"path":"/srv/<U+202E>gnp.exe"}'
    assert visible("a\u200bb\tc\nd") == "a<U+200B>b<U+0009>c\nd"
    assert visible("plain: é ü 日本") == "plain: é ü 日本"
