"""Long texts cut to a bound, saying how long they were (the whole ones stay in the history).

One marker for every place that must fit a text into a record of bounded size: the decisions and
question changes the worker publishes (processors/fitting.py) and compaction summaries.
"""

from __future__ import annotations


def cut_text(text: str, kept: int) -> str:
    """`text` whole if it has at most `kept` characters, else its first `kept` and a marker."""
    if len(text) <= kept:
        return text
    return f"{text[:kept]} […cut: {len(text)} characters in all, whole in the session's history]"
