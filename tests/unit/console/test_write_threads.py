"""Writes stuck on the log (Kafka down) hold threads of their own: reads and sign-ins answer."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anyio.to_thread
import pytest
from fastapi.testclient import TestClient

from console.auth import SESSION_COOKIE
from console.runtime import WRITE_THREADS
from console.settings import WebConsoleSettings
from producers.store import SessionStore
from schemas.events import Event
from session_model.ports import EventLog
from session_model.projection import Position
from tests.unit.builders import OPERATOR
from tests.unit.console.conftest import BEARER, NOW, make_app, page_csrf, sign_in

ANSWERED_WITHIN = 10.0  # seconds: generous, a loaded machine's; no timing target
GATE_S = 60.0  # an append never waits longer (a failing test must not hang the suite)


class GatedLog:
    """A log whose appends wait until the test opens the gate, as a Kafka append waits for its
    acknowledgement while Kafka is down (each holds its thread meanwhile)."""

    def __init__(self, inner: EventLog) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = 0  # appends waiting at the gate now
        self._lock = threading.Lock()

    def append(self, event: Event) -> Position:
        self._wait()
        return self.inner.append(event)

    def append_many(self, events: Sequence[Event]) -> list[Position]:
        self._wait()
        return self.inner.append_many(events)

    def _wait(self) -> None:
        with self._lock:
            self.waiting += 1
        try:
            self.gate.wait(GATE_S)
        finally:
            with self._lock:
                self.waiting -= 1


@pytest.fixture
def gated(settings: WebConsoleSettings) -> Iterator[tuple[TestClient, SessionStore, GatedLog]]:
    counter = itertools.count(1)
    store = SessionStore.in_memory(
        signer=OPERATOR, clock=lambda: NOW, new_id=lambda: f"ev-{next(counter)}"
    )
    log = GatedLog(store.log)
    store.log = log
    with TestClient(make_app(store, settings)) as client:
        yield client, store, log


def _shared_pool_size(client: TestClient) -> int:
    """The threads every request's blocking calls share (anyio's default limiter, 40)."""
    assert client.portal is not None

    def size() -> int:
        return int(anyio.to_thread.current_default_thread_limiter().total_tokens)

    return client.portal.call(size)


def _eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + ANSWERED_WITHIN
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _api_write(client: TestClient, session_id: str) -> int:
    body = {"because": "done"}
    return client.post(f"/api/v1/sessions/{session_id}/end", json=body, headers=BEARER).status_code


def _page_writer(client: TestClient) -> Callable[[TestClient, str], int]:
    """A form post as the operator signed in now (cookie sent explicitly: the client signs in
    again meanwhile)."""
    assert sign_in(client).status_code == 303
    csrf = page_csrf(client)
    cookie = f"{SESSION_COOKIE}={client.cookies[SESSION_COOKIE]}"
    client.cookies.clear()

    def write(client: TestClient, session_id: str) -> int:
        return client.post(
            f"/sessions/{session_id}/end",
            data={"csrf": csrf, "because": "done"},
            headers={"Cookie": cookie},
            follow_redirects=False,
        ).status_code

    return write


@pytest.mark.parametrize(("via", "accepted"), [("api", 202), ("page", 303)])
def test_writes_waiting_on_the_log_leave_reads_and_sign_ins_answering(
    gated: tuple[TestClient, SessionStore, GatedLog], via: str, accepted: int
) -> None:
    client, store, log = gated
    writes = _shared_pool_size(client) + WRITE_THREADS  # more than the whole shared pool
    sessions = [f"s-{n}" for n in range(writes)]
    for session_id in sessions:
        store.start(session_id, "wait for Kafka")
    write = _api_write if via == "api" else _page_writer(client)
    log.gate.clear()  # Kafka is down: every append waits
    with ThreadPoolExecutor(max_workers=writes + 1) as pool:
        try:
            pending = [pool.submit(write, client, s) for s in sessions]
            _eventually(lambda: log.waiting >= WRITE_THREADS, "the writes never reached the log")

            def answered(call: Callable[[], Any]) -> Any:
                found: Future[Any] = pool.submit(call)
                return found.result(timeout=ANSWERED_WITHIN)

            # Meanwhile the console reads, signs in and shows its pages.
            fleet = answered(lambda: client.get("/api/v1/fleet", headers=BEARER))
            assert fleet.status_code == 200
            assert answered(lambda: sign_in(client)).status_code == 303
            assert answered(lambda: client.get("/")).status_code == 200
            assert log.waiting <= WRITE_THREADS  # the others wait holding no thread
            assert not any(w.done() for w in pending)
        finally:
            log.gate.set()  # Kafka is back
        assert [w.result(timeout=GATE_S) for w in pending] == [accepted] * writes
    assert all(store.load(s).ended for s in sessions)
