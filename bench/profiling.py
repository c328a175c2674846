"""Summarising where a worker's time went, from what py-spy sampled (`deploy.host.PySpy`).

`py-spy record --format raw` writes collapsed stacks (`frame;frame;... count`, outermost first).
The summary gives self time (the innermost frame) and inclusive time (every frame on the stack,
counted once per sample) per function, as a share of the samples taken while the process was
busy (py-spy leaves idle threads out unless `--idle`).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::(?P<line>\d+))?\)$")


def _frame_name(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    for marker in ("site-packages/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        path = path.rsplit("/main/", 1)[-1]
    return f"{m.group('func')} ({path})"


# Where a sample's time goes: the first rule matching a frame, from the innermost frame outwards.
# "Weak" rules (the event loop itself) apply only when no other frame of the stack matches.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("scheduler (processors/scheduler.py)", ("processors/scheduler.py",)),
    ("decisions publish", ("_publish_decisions", "producers/decisions.py")),
    ("avro decode/encode (schemas/codec.py, fastavro)", ("schemas/codec.py", "fastavro")),
    (
        "commit arguments: state JSON, timeline JSON, indexes",
        ("commit_call", "projections/codec.py", "projections/indexes.py"),
    ),
    ("timeline entries (session_model/timeline.py)", ("session_model/timeline.py",)),
    ("fold (session_model)", ("session_model/",)),
    (
        "replay loop (processors/replay.py, projections/projector.py)",
        ("processors/replay.py", "projections/projector.py"),
    ),
    ("redis client (redis-py: pack, send, parse)", ("redis/", "hiredis")),
    ("redis store glue (projections/redis_store.py)", ("projections/redis_store.py",)),
    ("worker batch glue (processors/worker.py)", ("processors/worker.py",)),
    ("faust agent glue (processors/app.py)", ("processors/app.py",)),
    ("kafka consumer (aiokafka)", ("aiokafka/", "kafka/")),
    ("faust/mode machinery", ("faust/", "mode/")),
    ("metrics endpoint", ("prometheus_client", "processors/metrics.py", "wsgiref", "socketserver")),
)
WEAK: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("event loop (asyncio, selectors)", ("asyncio/", "selectors.py")),
)


# Frames every stack of the main thread passes through: they say nothing about where time goes.
WRAPPERS = (
    "mode/worker.py",
    "click/",
    "runpy",
    "milpa_sessions/cli.py",
    "bench/naive_projector.py",
)


def categorize(frames: list[str]) -> str:
    """The category of one sample's stack (outermost first)."""
    frames = [f for f in frames if not any(w in f for w in WRAPPERS)]
    for frame in reversed(frames):
        for name, needles in CATEGORIES:
            if any(n in frame for n in needles):
                return name
    for frame in reversed(frames):
        for name, needles in WEAK:
            if any(n in frame for n in needles):
                return name
    return "other"


@dataclass(frozen=True)
class ProfileSummary:
    """Self and inclusive shares per function, and shares per category."""

    samples: int
    self_share: list[tuple[str, float]]
    inclusive_share: list[tuple[str, float]]
    categories: list[tuple[str, float]]

    def render(self, top: int = 25) -> str:
        """A readable report."""
        lines = [f"{self.samples} samples (busy threads only)", "", "by category:"]
        lines += [f"  {share:5.1f}%  {name}" for name, share in self.categories]
        lines += ["", "self time:"]
        lines += [f"  {share:5.1f}%  {name}" for name, share in self.self_share[:top]]
        lines += ["", "inclusive time (project code):"]
        ours = [(n, s) for n, s in self.inclusive_share if _is_project(n)]
        lines += [f"  {share:5.1f}%  {name}" for name, share in ours[:top]]
        return "\n".join(lines)


_PROJECT = ("schemas/", "session_model/", "producers/", "processors/", "bench/")


def _is_project(name: str) -> bool:
    return any(f"({p}" in name for p in _PROJECT)


def summarize(raw: str, exclude_threads: tuple[str, ...] = ()) -> ProfileSummary:
    """Summarise py-spy's raw collapsed stacks."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    by_category: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = [f for f in stack.split(";") if f]
        if frames and any(frames[0].startswith(t) for t in exclude_threads):
            continue
        names = [_frame_name(f) for f in frames if not f.startswith(("process ", "thread "))]
        if not names:
            continue
        n = int(count_text)
        total += n
        own[names[-1]] += n
        by_category[categorize(names)] += n
        for name in set(names):
            inclusive[name] += n
    if total == 0:
        return ProfileSummary(0, [], [], [])
    return ProfileSummary(
        total,
        [(name, 100 * n / total) for name, n in own.most_common()],
        [(name, 100 * n / total) for name, n in inclusive.most_common()],
        [(name, 100 * n / total) for name, n in by_category.most_common()],
    )
