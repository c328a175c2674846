"""Reading question deadlines: an instant with an offset, or nothing that could ever expire."""

from __future__ import annotations

from datetime import UTC, datetime


def parse_deadline(text: object) -> datetime | None:
    """Return the deadline as an aware UTC instant, or None when absent or unreadable.

    Only an ISO-8601 instant that carries an offset (`Z` or `±hh:mm`) is readable: a naive time
    would have to be guessed into a zone, and a guessed deadline could end somebody's session.
    """
    if not isinstance(text, str) or "T" not in text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None or moment.utcoffset() is None:
        return None
    try:
        return moment.astimezone(UTC)
    except OverflowError:  # within an offset of the calendar's ends: the nearest instant held
        return (datetime.max if moment.year == datetime.max.year else datetime.min).replace(
            tzinfo=UTC
        )


def format_instant(moment: datetime) -> str:
    """Render an aware instant as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC, millisecond precision)."""
    utc = moment.astimezone(UTC)
    return utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"
