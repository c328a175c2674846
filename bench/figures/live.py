"""The live figure: how soon a question reaches a browser connected to the console (SSE)."""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from kafka import KafkaConsumer

from bench import infra
from bench.figures.common import TARGETS, Run, paced
from bench.stats import summary
from deploy.harness import free_port, wait_for
from producers.kafka_log import KafkaEventLog
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.events import Event


def live(run: Run) -> None:
    """Questions asked at a steady rate with a worker and the console running: the time from the
    broker's acknowledgement of the asking event to its `question` Server-Sent Event reaching a
    connected client. The fold sits in between (consume, fold, commit, publish), so this bounds
    fold → browser from above. Baseline: the same questions' records read straight from the
    questions topic by a consumer in this process (the feed's latency without the console)."""
    n, rate = run.sizes.live_questions, run.sizes.live_rate
    settings = run.settings("live")
    infra.create_topics(settings, run.cleanup)
    infra.register_prefix(settings, run.cleanup)
    token = secrets.token_urlsafe(24)
    tokens, secret = run.workdir / "live-tokens", run.workdir / "live-secret"
    tokens.write_text(f"bench:{hashlib.sha256(token.encode()).hexdigest()}\n")
    secret.write_text(secrets.token_urlsafe(32))
    port = free_port()
    console = replace(
        settings, console_port=port, console_tokens_file=tokens, console_secret_file=secret
    )
    worker = run.start("live-worker", settings)
    server = run.start(
        "live-console", console, command="console", metrics=False, loglevel="warning"
    )
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(url), timeout=60, what="the console")
    sids = [f"live-{run.tag}-{i:05d}" for i in range(n)]
    now = datetime.now(UTC)
    with KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic) as log:
        for i, sid in enumerate(sids):
            log.send(Event(f"{sid}-s", sid, ev.STARTED, now, "bench", {"goal": f"g{i}"}))
        log.flush(timeout=60)
        asks = [_ask(sid, now) for sid in sids]
        acked: dict[str, float] = {}
        sse, topic = _Reader(), _Reader()
        threads = [
            threading.Thread(target=sse.follow_sse, args=(url, token, n), daemon=True),
            threading.Thread(target=topic.follow_topic, args=(settings, n), daemon=True),
        ]
        for t in threads:
            t.start()
        if not (sse.ready.wait(30) and topic.ready.wait(30)):
            raise RuntimeError("the readers did not connect")
        time.sleep(1.0)  # the starts are folded; the readers are at the topic's end

        def on_ack(sid: str, _sent: float, _metadata: Any) -> None:
            acked[sid] = time.perf_counter()

        cpu = run.cpu({"worker": worker.pid, "console": server.pid})
        cpu.start()
        seconds, late = paced(log, asks, rate, on_ack)
        log.flush(timeout=60)
        for t in threads:
            t.join(30)
        usage = cpu.stop()
    to_browser = [(sse.seen[s] - acked[s]) * 1000 for s in sids if s in sse.seen and s in acked]
    to_topic = [(topic.seen[s] - acked[s]) * 1000 for s in sids if s in topic.seen and s in acked]
    browser, feed = summary(to_browser), summary(to_topic)
    run.log(f"live: ack → SSE p99 {browser['p99']} ms; ack → questions topic p99 {feed['p99']} ms")
    run.put(
        "live_question_to_browser_p99_ms",
        browser["p99"],
        "ms",
        baseline=feed["p99"],
        target=TARGETS["live_p99"],
        params={
            "questions": n,
            "asked_per_s": rate,
            "seconds": seconds,
            "late_sends": late,
            "received": len(to_browser),
            "ack_to_sse_ms": browser,
            "ack_to_questions_topic_ms": feed,
            "client": "httpx streaming GET /api/v1/events with a bearer token (the browser's "
            "EventSource reads the same stream)",
            "from": "the broker's acknowledgement of the question_asked event (before the fold)",
            "baseline": "the same records consumed from the questions topic by kafka-python "
            "in the bench process",
            "cpu": usage,
        },
    )


def _ask(sid: str, now: datetime) -> Event:
    payload = {
        "question_id": "q1",
        "question": "May I?",
        "options": ["yes", "no"],
        "why": None,
        "expires_at": (now + timedelta(hours=1)).isoformat(),
        "reason": "permission",
    }
    return Event(f"{sid}-q", sid, ev.QUESTION_ASKED, now, "bench", payload)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/login", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class _Reader:
    """When each session's `open` question change arrived (perf_counter), by session."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}
        self.ready = threading.Event()

    def follow_sse(self, url: str, token: str, n: int) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        deadline = time.monotonic() + 120
        with (
            httpx.Client(timeout=httpx.Timeout(10, read=30)) as client,
            client.stream("GET", f"{url}/api/v1/events", headers=headers) as stream,
        ):
            self.ready.set()
            event = ""
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event == "question":
                    at = time.perf_counter()
                    data = json.loads(line[5:])
                    if data.get("status") == "open":
                        self.seen.setdefault(data["session_id"], at)
                if len(self.seen) >= n or time.monotonic() > deadline:
                    return

    def follow_topic(self, settings: Any, n: int) -> None:
        codec = EventCodec()
        consumer = KafkaConsumer(
            settings.questions_topic,
            **settings.kafka_access().kafka_python(),
            group_id=None,
            auto_offset_reset="latest",
            fetch_max_wait_ms=10,
        )
        try:
            deadline = time.monotonic() + 120
            while not consumer.assignment():
                consumer.poll(timeout_ms=100)
            self.ready.set()
            while len(self.seen) < n and time.monotonic() < deadline:
                for records in consumer.poll(timeout_ms=200).values():
                    at = time.perf_counter()
                    for r in records:
                        change = codec.decode_question_change(r.value)
                        if change["status"] == "open":
                            self.seen.setdefault(change["session_id"], at)
        finally:
            consumer.close()
