"""The live feed: the hub's fan-out, the SSE text, the feed's restarts, and the endpoint itself."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from console.api import _still_signed_in
from console.auth import (
    SESSION_COOKIE,
    Identity,
    hash_password,
    operator_principal,
    service_principal,
    token_digest,
)
from console.live import (
    CLOSED,
    RESYNC,
    Hub,
    TooManyStreamsError,
    drain,
    event_stream,
    feeding,
    idle_wait,
)
from console.settings import WebConsoleSettings
from milpa_sessions.console_cli import write_user
from producers.store import SessionStore
from session_model.principal import Principal
from session_model.questions import QuestionChange, QuestionStatus
from tests.unit.console.conftest import NOW, READER_TOKEN, TOKEN, at, make_app, sign_in


def change(
    session_id: str = "s1", status: QuestionStatus = QuestionStatus.OPEN, seq: int = 3, **kw: Any
) -> QuestionChange:
    fields: dict[str, Any] = {
        "session_id": session_id,
        "status": status,
        "question_id": "perm:deploy",
        "question": "Allow «deploy»?",
        "options": ("yes", "no"),
        "reason": "permission",
        "why": "{}",
        "expires_at": at(60),
        "asked_at": NOW,
        "seq": seq,
        "mode": "ask",
        "goal": "ship",
        "event_id": f"ev-{session_id}-{seq}-{status}",
        "at": NOW,
    }
    fields.update(kw)
    return QuestionChange(**fields)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


# -- the hub ---------------------------------------------------------------------------------------


def test_the_hub_hands_each_change_to_every_subscriber_once() -> None:
    async def scenario() -> None:
        hub = Hub()
        a, b = hub.subscribe(), hub.subscribe()
        opened = change()
        assert hub.publish(opened)
        assert not hub.publish(opened)  # a redelivery
        answered = change(status=QuestionStatus.ANSWERED, answer="yes")
        assert hub.publish(answered)
        assert not hub.publish(change())  # older than what was seen for s1
        for sub in (a, b):
            assert await sub.get() == opened
            assert await sub.get() == answered
            assert sub.queue.empty()
        hub.unsubscribe(a)
        assert hub.subscribers == 1

    run(scenario())


def test_the_hub_remembers_a_bounded_number_of_sessions() -> None:
    async def scenario() -> None:
        hub = Hub(seen_sessions=2)
        for sid in ("s1", "s2", "s3"):
            assert hub.publish(change(sid))
        assert not hub.publish(change("s3"))
        assert hub.publish(change("s1"))  # forgotten (the oldest): passed on again

    run(scenario())


def test_a_slow_subscriber_loses_its_backlog_and_is_told_to_resync() -> None:
    async def scenario() -> None:
        hub = Hub(queue_size=3)
        slow = hub.subscribe()
        for n in range(5):
            hub.publish(change(f"s{n}"))
        items = [slow.queue.get_nowait() for _ in range(slow.queue.qsize())]
        assert RESYNC in items
        assert slow.dropped >= 3
        assert items[-1] == change("s4")  # it goes on receiving after the resync

    run(scenario())


def test_closing_the_hub_ends_every_stream() -> None:
    async def scenario() -> None:
        hub = Hub()
        sub = hub.subscribe()
        hub.close()
        assert await sub.get() is CLOSED
        assert hub.subscribers == 0
        assert await hub.subscribe().get() is CLOSED

    run(scenario())


# -- the SSE text ----------------------------------------------------------------------------------


def test_the_stream_sends_ready_then_question_events_and_keepalives() -> None:
    async def scenario() -> None:
        hub = Hub()
        disconnected = False

        async def is_disconnected() -> bool:
            return disconnected

        stream = event_stream(hub, is_disconnected, keepalive=0.01)
        first = await anext(stream)
        assert first.startswith("retry: 3000\n") and "event: ready\n" in first
        assert await anext(stream) == ": keepalive\n\n"
        hub.publish(change(by=None))
        text = await anext(stream)
        assert text.startswith("event: question\ndata: ") and text.endswith("\n\n")
        data = json.loads(text.split("data: ", 1)[1])
        assert data["session_id"] == "s1" and data["status"] == "open"
        assert data["deadline_ms"] == int((NOW + timedelta(seconds=60)).timestamp() * 1000)
        hub.publish(change(status=QuestionStatus.ANSWERED, answer="yes", by=Principal("a", True)))
        answered = json.loads((await anext(stream)).split("data: ", 1)[1])
        assert answered["by"] == {"id": "a", "verified": True}
        hub.resync()
        assert await anext(stream) == "event: resync\ndata: {}\n\n"
        disconnected = True
        assert [s async for s in stream] == []  # the next idle check sees the client gone
        assert hub.subscribers == 0

    run(scenario())


def test_the_stream_ends_once_its_caller_signed_out() -> None:
    async def scenario() -> None:
        hub = Hub()
        signed_in = True

        async def connected() -> bool:
            return False

        async def still() -> bool:
            return signed_in

        stream = event_stream(hub, connected, keepalive=0.01, still_signed_in=still, recheck=0)
        await anext(stream)  # ready
        hub.publish(change())
        assert (await anext(stream)).startswith("event: question")
        signed_in = False
        hub.publish(change(seq=4))
        assert [s async for s in stream] == []  # nothing more is sent after the sign-out
        assert hub.subscribers == 0
        idle = event_stream(hub, connected, keepalive=0.01, still_signed_in=still, recheck=0)
        await anext(idle)
        assert [s async for s in idle] == []  # an idle stream ends at its next keepalive check

    run(scenario())


def test_a_busy_stream_asks_about_its_sign_out_once_per_recheck_interval() -> None:
    """A fleet's changes do not cost a sign-out read each; past the interval, it asks again."""

    async def scenario() -> None:
        hub = Hub()
        asked = 0
        signed_in = True

        async def connected() -> bool:
            return False

        async def still() -> bool:
            nonlocal asked
            asked += 1
            return signed_in

        stream = event_stream(hub, connected, keepalive=60, still_signed_in=still, recheck=0.2)
        await anext(stream)  # ready
        for seq in range(1, 51):
            hub.publish(change(seq=seq))
            assert (await anext(stream)).startswith("event: question")
        assert asked == 0  # all within the interval after it was authenticated
        await asyncio.sleep(0.25)
        signed_in = False
        hub.publish(change(seq=51))
        assert [s async for s in stream] == []  # asked again past the interval: signed out
        assert asked == 1

    run(scenario())


async def _rest(stream: AsyncIterator[str]) -> list[str]:
    return [s async for s in stream]


def test_an_idle_stream_ends_at_its_next_sign_out_check_not_its_next_keepalive() -> None:
    async def scenario() -> None:
        hub = Hub()
        asked = 0

        async def connected() -> bool:
            return False

        async def still() -> bool:
            nonlocal asked
            asked += 1
            return asked < 3  # signed out before the third check

        stream = event_stream(hub, connected, keepalive=3600, still_signed_in=still, recheck=0.01)
        await anext(stream)  # ready
        # Generous: it takes three rechecks (30 ms); a keepalive would be an hour away.
        assert await asyncio.wait_for(_rest(stream), 5) == []  # no keepalive sent while idle
        assert asked == 3 and hub.subscribers == 0

    run(scenario())


def test_an_idle_stream_still_sends_keepalives_between_its_sign_out_checks() -> None:
    async def scenario() -> None:
        hub = Hub()
        asked = 0

        async def connected() -> bool:
            return False

        async def still() -> bool:
            nonlocal asked
            asked += 1
            return True

        stream = event_stream(hub, connected, keepalive=0.05, still_signed_in=still, recheck=0.01)
        await anext(stream)  # ready
        for n in (1, 2):
            assert await asyncio.wait_for(anext(stream), 5) == ": keepalive\n\n"
            assert asked >= n  # checked before each keepalive went out
        await stream.aclose()
        assert hub.subscribers == 0

    run(scenario())


def test_an_idle_stream_wakes_for_its_keepalive_or_its_sign_out_check_whichever_comes_first() -> (
    None
):
    assert idle_wait(10.0, sent=10.0, keepalive=15.0, confirmed=10.0, recheck=1.0) == 1.0
    assert idle_wait(10.5, sent=10.0, keepalive=15.0, confirmed=10.0, recheck=1.0) == 0.5
    assert idle_wait(24.5, sent=10.0, keepalive=15.0, confirmed=24.0, recheck=1.0) == 0.5
    assert idle_wait(12.0, sent=10.0, keepalive=15.0, confirmed=10.0, recheck=1.0) == 0.0
    # A recheck of 0 asks before each item: an idle stream then wakes for its keepalives only.
    assert idle_wait(10.0, sent=10.0, keepalive=15.0, confirmed=10.0, recheck=0.0) == 15.0


# -- draining the feed -----------------------------------------------------------------------------


def test_a_failing_feed_is_restarted_with_backoff_and_subscribers_resync() -> None:
    async def scenario() -> None:
        hub = Hub()
        sub = hub.subscribe()
        attempts = 0
        sleeps: list[float] = []

        async def source() -> AsyncIterator[QuestionChange]:
            nonlocal attempts
            attempts += 1
            if attempts <= 2:
                raise ConnectionError("broker gone")
            yield change()

        async def sleep(seconds: float) -> None:
            sleeps.append(seconds)

        await drain(source, hub, first_backoff=1.0, sleep=sleep)
        assert attempts == 3 and sleeps == [1.0, 2.0]
        assert [sub.queue.get_nowait() for _ in range(3)] == [RESYNC, RESYNC, change()]

    run(scenario())


def test_feeding_drains_the_source_while_the_app_runs() -> None:
    async def scenario() -> None:
        hub = Hub()
        sub = hub.subscribe()

        async def source() -> AsyncIterator[QuestionChange]:
            yield change()
            await asyncio.Event().wait()  # a live feed never ends by itself

        async with feeding(source, hub):
            assert await sub.get() == change()
        assert await sub.get() is CLOSED

    run(scenario())


def test_the_apps_lifespan_runs_the_source(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    started: list[bool] = []

    async def source() -> AsyncIterator[QuestionChange]:
        started.append(True)
        yield change()

    app = make_app(store, settings, source=source)
    with TestClient(app) as client:
        client.get("/login")
    assert started == [True]
    assert app.state.console.hub.closed


# -- the endpoint over ASGI ------------------------------------------------------------------------


def _events_scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/api/v1/events",
        "raw_path": b"/api/v1/events",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver"), *headers],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
        "state": {},
    }


async def _stream_one(app: FastAPI, headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    """Call GET /api/v1/events, publish one change once subscribed, then disconnect."""
    hub = app.state.console.hub
    sent: list[dict[str, Any]] = []
    got = asyncio.Event()
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if b"event: question" in message.get("body", b""):
            got.set()
        if message["type"] == "http.response.start" and message["status"] != 200:
            got.set()

    task = asyncio.create_task(app(_events_scope(headers), receive, send))
    for _ in range(500):
        if hub.subscribers or task.done():
            break
        await asyncio.sleep(0.01)
    if hub.subscribers:
        hub.publish(change())
    await asyncio.wait_for(got.wait(), 5)
    gone.set()
    await asyncio.wait_for(task, 5)
    assert hub.subscribers == 0
    return sent


def test_the_events_endpoint_streams_a_published_change(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    app = make_app(store, settings)
    sent = run(_stream_one(app, [(b"authorization", f"Bearer {TOKEN}".encode())]))
    start = sent[0]
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"event: ready" in body
    event = body.split(b"event: question\ndata: ", 1)[1].split(b"\n\n", 1)[0]
    assert json.loads(event)["question_id"] == "perm:deploy"


def test_the_events_endpoint_refuses_strangers(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    app = make_app(store, settings)
    sent = run(_stream_one(app, []))
    assert sent[0]["status"] == 401


BEARER = [(b"authorization", f"Bearer {TOKEN}".encode())]
DEPLOYER = "service:deployer"  # TOKEN's principal


@pytest.fixture
def one_stream(store: SessionStore, settings: WebConsoleSettings) -> FastAPI:
    """The console, one live stream per caller."""
    return make_app(store, dataclasses.replace(settings, console_streams_per_caller=1))


def test_a_caller_holds_at_most_its_limit_of_streams_and_gets_a_429_past_it(
    one_stream: FastAPI,
) -> None:
    app, hub = one_stream, one_stream.state.console.hub

    async def scenario() -> None:
        held = hub.subscribe("service:other", 1)  # another caller's stream does not count
        gone = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def ignore(message: dict[str, Any]) -> None:
            pass

        first = asyncio.create_task(app(_events_scope(BEARER), receive, ignore))
        while hub.held(DEPLOYER) < 1:
            await asyncio.sleep(0.01)
        refused: list[dict[str, Any]] = []

        async def collect(message: dict[str, Any]) -> None:
            refused.append(message)

        await app(_events_scope(BEARER), receive, collect)
        assert refused[0]["status"] == 429
        assert dict(refused[0]["headers"])[b"retry-after"] == b"30"
        assert json.loads(refused[1]["body"])["code"] == "too_many_streams"
        gone.set()
        await asyncio.wait_for(first, 5)
        hub.unsubscribe(held)
        assert hub.subscribers == 0 and hub.held(DEPLOYER) == 0

    run(scenario())


def test_a_stream_whose_client_left_before_its_first_byte_is_released(one_stream: FastAPI) -> None:
    app, hub = one_stream, one_stream.state.console.hub

    async def scenario() -> None:
        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            raise AssertionError

        async def gone(message: dict[str, Any]) -> None:
            raise OSError("the client went")

        for _ in range(2):  # the second is not refused: the first was released
            with contextlib.suppress(OSError):
                await app(_events_scope(BEARER), receive, gone)
            assert hub.subscribers == 0 and hub.held(DEPLOYER) == 0

    run(scenario())


def test_the_hub_counts_each_owners_streams_against_its_limit() -> None:
    hub = Hub()
    a1, a2 = hub.subscribe("a", 2), hub.subscribe("a", 2)
    with pytest.raises(TooManyStreamsError):
        hub.subscribe("a", 2)
    hub.subscribe("b", 2)
    hub.subscribe("a")  # no limit given: none applies
    assert hub.held("a") == 3
    hub.unsubscribe(a1)
    hub.unsubscribe(a1)  # twice: counted once
    assert hub.held("a") == 2
    hub.unsubscribe(a2)
    assert hub.subscribe("a", 2) is not None
    hub.close()
    assert hub.held("a") == 0 and hub.subscribers == 0


def _signed_in(app: FastAPI, cookie: str, session_id: str) -> bool:
    """What a live stream opened with this session cookie is told when it checks."""
    header = (b"cookie", f"{SESSION_COOKIE}={cookie}".encode())
    request = Request({"type": "http", "app": app, "headers": [header]})
    caller = Identity(operator_principal("alice"), "cookie", "", session_id, relaxes=True)
    return bool(run(_still_signed_in(request, caller)))


def _bearer_holds(app: FastAPI, token: str, name: str) -> bool:
    """What a live stream opened with this bearer token, as service `name`, is told."""
    header = (b"authorization", f"Bearer {token}".encode())
    request = Request({"type": "http", "app": app, "headers": [header]})
    caller = Identity(service_principal(name), "bearer")
    return bool(run(_still_signed_in(request, caller)))


def test_a_bearer_stream_ends_once_its_token_is_taken_out_of_the_tokens_file(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    """A withdrawn token is refused within a second, no restart, its live streams included."""
    now = [0.0]
    app = make_app(store, settings, monotonic=lambda: now[0])
    with TestClient(app) as client:
        bearer = {"Authorization": f"Bearer {READER_TOKEN}"}
        assert client.get("/api/v1/questions", headers=bearer).status_code == 200
        assert _bearer_holds(app, READER_TOKEN, "bridge")
        assert not _bearer_holds(app, READER_TOKEN, "deployer")  # another service's stream
        assert settings.console_tokens_file is not None
        settings.console_tokens_file.write_text(f"deployer:{token_digest(TOKEN)}:operator\n")
        now[0] += 1.0
        assert not _bearer_holds(app, READER_TOKEN, "bridge")
        assert client.get("/api/v1/questions", headers=bearer).status_code == 401
        deployer = {"Authorization": f"Bearer {TOKEN}"}
        assert client.get("/api/v1/questions", headers=deployer).status_code == 200
        assert _bearer_holds(app, TOKEN, "deployer")


def test_a_cookie_stream_ends_once_its_sign_in_no_longer_holds(
    store: SessionStore, settings: WebConsoleSettings
) -> None:
    """Signed out, or its operator's password changed in the users file: the stream's check says
    no, as the cookie would now be refused."""
    now = [0.0]
    app = make_app(store, settings, monotonic=lambda: now[0])
    rt = app.state.console
    with TestClient(app) as client:
        cookies = []
        for _ in range(2):  # two sessions of alice's
            assert sign_in(client).status_code == 303
            cookies.append(client.cookies[SESSION_COOKIE])
            client.cookies.clear()
    (one, sid_one), (two, sid_two) = [
        (c, rt.cookies.read(c, rt.passwords.hash_of).session_id) for c in cookies
    ]
    assert _signed_in(app, one, sid_one) and _signed_in(app, two, sid_two)
    assert not _signed_in(app, one, sid_two)  # another session's cookie is not this stream's
    rt.cookies.revoke(sid_one)
    assert not _signed_in(app, one, sid_one) and _signed_in(app, two, sid_two)  # signed out
    assert settings.console_users_file is not None
    write_user(settings.console_users_file, "alice", hash_password("a new passphrase"))
    now[0] += 1.0
    assert not _signed_in(app, two, sid_two)  # alice's password changed
