"""`milpa-sessions stats`: pauses by reason, hour and outcome, time to answer, rejections.

The parent group puts its settings and `--json` flag on the root click context; this module reads
them from there (importing `milpa_sessions.cli` here would be an import cycle).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast

import click
from rich.console import Console
from rich.table import Table

from milpa_sessions import wiring
from milpa_sessions.failures import CleanGroup, close_at_end
from milpa_sessions.render import add_literal_row
from milpa_sessions.settings import Settings
from projections.analytics import (
    GROUPINGS,
    Analytics,
    Count,
    Grouping,
    PausesByHour,
    PausesByOutcome,
    PausesByReason,
    parse_hour,
    window_hours,
)
from projections.indexes import TTA_BUCKETS

out = Console()
err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])
_DURATION = re.compile(r"^\s*(\d+)\s*([mhd])\s*$", re.IGNORECASE)
_UNITS = {"m": "minutes", "h": "hours", "d": "days"}
MAX_WINDOW = timedelta(days=366)


def parse_since(text: str) -> timedelta | None:
    """`30m`, `24h`, `7d` → a window; `all` → None (no limit); anything else is a bad parameter."""
    if text.strip().lower() == "all":
        return None
    match = _DURATION.match(text)
    if match is None:
        raise click.BadParameter(
            f"{text!r} is not a duration: use <n>m, <n>h, <n>d (e.g. 30m, 24h, 7d) or all",
            param_hint="'--since'",
        )
    amount, unit = int(match.group(1)), match.group(2).lower()
    if amount <= 0:
        raise click.BadParameter(f"{text!r}: the window must be positive", param_hint="'--since'")
    try:
        window = timedelta(**{_UNITS[unit]: amount})
    except OverflowError:
        window = MAX_WINDOW + MAX_WINDOW
    if window > MAX_WINDOW:  # one hour key per hour: beyond a year, read the all-time totals
        raise click.BadParameter(
            f"{text!r} is longer than {MAX_WINDOW.days}d: use --since all", param_hint="'--since'"
        )
    return window


def _since_option(ctx: click.Context, param: click.Parameter, value: str) -> timedelta | None:
    return parse_since(value)


def _settings() -> tuple[Settings, bool]:
    """The root context's settings and `--json` flag (from the environment if run standalone)."""
    obj = click.get_current_context().find_root().obj
    settings = getattr(obj, "settings", None)
    if not isinstance(settings, Settings):
        settings = Settings.from_env(os.environ)
    return settings, bool(getattr(obj, "as_json", False))


def _analytics(settings: Settings) -> Analytics:
    store = wiring.projection_store(settings)
    close_at_end(store.close)
    return Analytics(store.client, store.keys)


def _emit(as_json: bool, data: Any, render: Callable[[], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str, ensure_ascii=False))
    else:
        render()


def describe_window(since: timedelta | None, now: datetime) -> str:
    """How a table title names the window (hour buckets are whole UTC hours)."""
    if since is None:
        return "all time"
    hours = window_hours(since, now)
    start = parse_hour(hours[0]).strftime("%Y-%m-%d %H:00")
    return f"since {start} UTC ({len(hours)} hour buckets)"


def pause_rows_json(rows: Sequence[PausesByReason | PausesByHour | PausesByOutcome]) -> list[Any]:
    """Rows as JSON-ready dicts (hours as ISO-8601)."""
    data: list[Any] = []
    for row in rows:
        item = asdict(row)
        if isinstance(row, PausesByHour):
            item["hour"] = row.hour.isoformat()
        data.append(item)
    return data


@click.group(cls=CleanGroup)
def stats() -> None:
    """Analytics: why sessions pause, how they end, how fast humans answer."""


@stats.command()
@click.option(
    "--since",
    default="24h",
    show_default=True,
    callback=_since_option,
    help="Window: <n>m, <n>h, <n>d, or all (whole UTC hours).",
)
@click.option("--by", "by", type=click.Choice(GROUPINGS), default="reason", show_default=True)
def pauses(since: timedelta | None, by: str) -> None:
    """Pauses (questions asked) by reason, hour or outcome."""
    settings, as_json = _settings()
    now = datetime.now(UTC)
    rows = _analytics(settings).pauses(since, now, cast(Grouping, by))
    title = f"pauses by {by}, {describe_window(since, now)}"

    def render() -> None:
        if by == "hour":
            table = Table("hour (UTC)", "reason", "pauses", title=title)
            for r in rows:
                assert isinstance(r, PausesByHour)
                add_literal_row(table, r.hour.strftime("%Y-%m-%d %H:00"), r.reason, str(r.count))
        elif by == "outcome":
            table = Table("outcome", "reason", "pauses", title=title)
            for r in rows:
                assert isinstance(r, PausesByOutcome)
                add_literal_row(table, r.outcome.replace("_", " "), r.reason, str(r.count))
        else:
            table = Table("reason", "pauses", "answered", "expired", "still open", title=title)
            reasons = [r for r in rows if isinstance(r, PausesByReason)]
            for r in reasons:
                add_literal_row(
                    table,
                    r.reason,
                    str(r.pauses),
                    str(r.answered),
                    str(r.expired),
                    str(r.still_open),
                )
            if reasons:
                table.add_section()
                table.add_row(
                    "total",
                    *(
                        str(sum(getattr(r, f) for r in reasons))
                        for f in ("pauses", "answered", "expired", "still_open")
                    ),
                )
        out.print(table if rows else f"no pauses ({describe_window(since, now)})")

    _emit(as_json, pause_rows_json(rows), render)


@stats.command()
def tta() -> None:
    """Time to answer: histogram per reason (answered questions only)."""
    settings, as_json = _settings()
    rows = _analytics(settings).time_to_answer()

    def render() -> None:
        totals: dict[str, int] = {}
        for r in rows:
            totals[r.reason] = totals.get(r.reason, 0) + r.count
        if not any(totals.values()):
            out.print("no answered questions yet")
            return
        table = Table("reason", "answered within", "count", "cumulative", title="time to answer")
        running: dict[str, int] = {}
        for r in rows:
            running[r.reason] = running.get(r.reason, 0) + r.count
            if r.count == 0:
                continue
            if r.le_seconds is not None:
                within = f"≤ {_seconds(r.le_seconds)}"
            else:
                within = f"> {_seconds(max(TTA_BUCKETS))}"
            share = f"{100 * running[r.reason] / totals[r.reason]:.0f}%"
            add_literal_row(table, r.reason, within, str(r.count), share)
        out.print(table)

    _emit(as_json, [asdict(r) for r in rows], render)


def _seconds(value: int) -> str:
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if value >= size and value % size == 0:
            return f"{value // size}{unit}"
    return f"{value}s"


def _counts_table(title: str, header: str, rows: Sequence[Count]) -> None:
    if not rows:
        out.print(f"no {title}")
        return
    table = Table(header, "count", title=title)
    for r in rows:
        add_literal_row(table, r.name, str(r.count))
    out.print(table)


@stats.command()
def rejections() -> None:
    """Rejected events by code, and authority claims the fold downgraded."""
    settings, as_json = _settings()
    analytics = _analytics(settings)
    codes, downgrades = analytics.rejections(), analytics.downgrades()

    def render() -> None:
        _counts_table("rejections", "code", codes)
        _counts_table("downgrades", "kind", downgrades)

    data = {
        "rejections": [asdict(r) for r in codes],
        "downgrades": [asdict(r) for r in downgrades],
    }
    _emit(as_json, data, render)
