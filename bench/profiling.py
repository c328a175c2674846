"""Where a worker's time went, by this project's categories, from what py-spy sampled.

`deploy.host` samples (`PySpy`) and summarises (`summarize_py_spy`: self and inclusive shares per
function); the categories below say which part of the pipeline a sample's stack belongs to.
"""

from __future__ import annotations

from deploy.host import ProfileSummary, summarize_py_spy

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
    (
        "redis store glue (projections/redis_store.py, requests.py)",
        ("projections/redis_store.py", "projections/requests.py"),
    ),
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


PROJECT = (
    "schemas/",
    "session_model/",
    "projections/",
    "producers/",
    "processors/",
    "bench/",
)


def summarize(raw: str) -> ProfileSummary:
    """Summarise py-spy's raw collapsed stacks with this project's categories."""
    return summarize_py_spy(raw, categorize, PROJECT)
