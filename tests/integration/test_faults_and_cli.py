"""Faults an operator meets: bad settings, services down or hung, SIGTERM while Redis is down.

Every CLI command ends with one line and a non-zero exit within a few seconds (never a traceback
or a hang); a worker stops within its grace period whatever Redis does.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from deploy.harness import REPO, Proc, free_port, wait_for
from milpa_sessions.cli import main
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from producers.store import SessionStore
from projections.redis_store import RedisProjectionStore
from session_model.policy import permission_question
from tests.integration.conftest import health, with_keys
from tests.unit.builders import started, turn

pytestmark = pytest.mark.integration

READERS = [
    ["list"],
    ["show", "s1"],
    ["window", "s1"],
    ["timeline", "s1"],
    ["stats", "pauses"],
    ["stats", "tta"],
    ["stats", "rejections"],
]
WRITERS = [
    ["answer", "s1", "q1", "yes"],
    ["grant", "s1", "deploy"],
    ["revoke", "s1", "deploy"],
    ["mode", "s1", "ask"],
    ["end", "s1", "done"],
    ["topics", "create"],
    ["replay"],
]


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A loopback address that accepts connections and never answers (a hung service)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for c in held:
        c.close()
    server.close()


# Started with every batch: the CLI's start-up alone (interpreter, imports, settings read; no
# connection), competing for the same cores. Sixteen processes importing at once on two cores take
# seconds before any of them can time out, more on a slower or busier machine: the bounds below
# are the product's own time-outs on top of what these took in the same batch.
REFERENCE = ["--help"]
REFERENCES = 2


def _run_all(commands: list[list[str]], env: dict[str, str]) -> list[tuple[list[str], Any]]:
    """Run the commands at once (each waits on a timeout, not on the CPU), with `REFERENCES`
    start-up-only runs of the CLI among them; their outcomes, the references' last."""
    batch = [*commands, *[REFERENCE] * REFERENCES]
    procs = [
        (
            cmd,
            time.monotonic(),
            subprocess.Popen(
                [sys.executable, "-m", "milpa_sessions.cli", *cmd],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for cmd in batch
    ]
    results = []
    for cmd, began, proc in procs:
        _, err = proc.communicate(timeout=120)
        results.append((cmd, (proc.returncode, err, time.monotonic() - began)))
    return results


def _assert_one_line_failures(
    results: list[tuple[list[str], Any]], naming: str, within: float
) -> None:
    """Every command failed with one line naming `naming`, at most `within` seconds later than
    the slowest start-up-only run of the same batch."""
    commands, references = results[:-REFERENCES], results[-REFERENCES:]
    for cmd, (rc, err, _) in references:
        assert rc == 0, f"{cmd}: {err}"
    start_up = max(took for _, (_, _, took) in references)
    for cmd, (rc, err, took) in commands:
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc != 0, f"{cmd}: exit 0"
        assert "Traceback" not in err, f"{cmd}: {err}"
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{cmd}: {err!r}"
        assert naming in lines[0], f"{cmd}: {lines[0]!r} does not name {naming}"
        assert took < start_up + within, f"{cmd} took {took:.1f}s (start-up {start_up:.1f}s)"


def _env(settings: Settings, **extra: str) -> dict[str, str]:
    return {**os.environ, **settings.to_env(), **extra}


# Every command fails on reading its settings, before it connects: TLS and ACLs change nothing here.
@pytest.mark.fault_load
@pytest.mark.parametrize(
    ("name", "value"),
    [("MILPA_PARTITIONS", "abc"), ("MILPA_REDIS_URL", "nope://x"), ("MILPA_REDIS_TIMEOUT", "x")],
)
def test_a_bad_setting_ends_every_command_with_one_line(
    settings: Settings, name: str, value: str
) -> None:
    # Every command once (the settings are read in one place, the group's callback), then a
    # reader, a writer and the worker for each other kind of bad value.
    commands = [*READERS, *WRITERS, ["worker"], ["scheduler"]]
    if name == "MILPA_REDIS_URL":  # read only by what touches Redis
        commands = [["show", "s1"], ["worker"], ["scheduler"]]
    elif name != "MILPA_PARTITIONS":
        commands = [["show", "s1"], ["grant", "s1", "deploy"], ["worker"]]
    results = _run_all(commands, _env(settings, **{name: value}))
    _assert_one_line_failures(results, "ConfigurationError", within=10)


def test_an_unreachable_or_hung_redis_ends_every_reader_within_seconds(
    settings: Settings, black_hole: str
) -> None:
    refused = f"redis://127.0.0.1:{free_port()}/0"
    for url in (refused, f"redis://{black_hole}/0"):
        results = _run_all([*READERS, ["replay"]], _env(settings, MILPA_REDIS_URL=url))
        # replay first asks Kafka whether workers run (fine), then fails on Redis.
        _assert_one_line_failures(results, "Redis at", within=15)


def test_an_unreachable_or_hung_broker_ends_every_writer_within_seconds(
    settings: Settings,
    kafka_store: SessionStore,
    start_worker: Any,
    black_hole: str,
    tmp_path: Path,
) -> None:
    # The operator's key: `grant` must reach the broker to fail on it (without a key it is
    # refused before, with its own one line).
    made = CliRunner().invoke(main, ["keys", "generate", "ops", "--dir", str(tmp_path)])
    assert made.exit_code == 0, made.output
    settings = with_keys(settings, signing_key=tmp_path / "ops.key")
    worker = start_worker()
    kafka_store.start("s1", "be steered", mode="ask")
    question = permission_question("deploy", {"to": "prod"}, expires_at=None)
    kafka_store.ask("s1", question)
    wait_for(lambda: _open(kafka_store, "s1"), timeout=60)
    worker.stop()
    writers = [["answer", "s1", question.id, "yes"], *WRITERS[1:]]
    refused = f"127.0.0.1:{free_port()}"
    for bootstrap in (refused, black_hole):
        results = _run_all(writers, _env(settings, MILPA_KAFKA_BOOTSTRAP=bootstrap))
        _assert_one_line_failures(results, "Kafka at", within=15)
    # Reading needs no broker.
    shown = _run_all([["show", "s1"]], _env(settings, MILPA_KAFKA_BOOTSTRAP=refused))
    assert shown[0][1][0] == 0, shown[0]


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A redis-server of this test's own, which it may stop and start."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    state: dict[str, Any] = {"url": f"redis://127.0.0.1:{port}/0", "args": args}

    def start() -> None:
        state["proc"] = Proc.start("redis", args, tmp_path / "redis.log", cwd=tmp_path)
        client = redis.Redis.from_url(state["url"], socket_timeout=1)
        wait_for(lambda: _pings(client), timeout=20)

    def stop() -> None:
        state["proc"].kill9()

    state["start"], state["stop"] = start, stop
    start()
    yield state
    if state["proc"].alive():
        stop()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.mark.plain_stack  # a plaintext service of its own
def test_sigterm_stops_a_worker_within_the_grace_while_redis_is_down(
    settings: Settings, kafka_log: KafkaEventLog, private_redis: dict[str, Any], start_worker: Any
) -> None:
    grace = 4.0
    s = with_keys(settings, redis_url=private_redis["url"], shutdown_grace=grace)
    worker = start_worker(s)
    projections = RedisProjectionStore.from_url(private_redis["url"], s.redis_keys())
    kafka_log.append(started("outlive redis", session_id="s-down"))
    wait_for(lambda: projections.load("s-down") is not None, timeout=60)
    private_redis["stop"]()
    for i in range(20):  # a batch the worker cannot commit: it retries Redis
        kafka_log.append(turn("user", f"turn {i}", session_id="s-down"))
    wait_for(lambda: "redis unavailable" in worker.log(), timeout=30)
    began = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    rc = worker.proc.wait(timeout=grace + 20)
    took = time.monotonic() - began
    assert took < grace + 3, f"stopped after {took:.1f}s (grace {grace}s): {worker.log()[-2000:]}"
    assert rc != 0 or took < grace  # a forced exit says so with its status
    # Nothing lost: with Redis back, a new worker applies the turns (they were not committed).
    private_redis["start"]()
    again = start_worker(s)
    projections = RedisProjectionStore.from_url(private_redis["url"], s.redis_keys())
    # Redis lost everything (no persistence): the session comes back by replay; here we check
    # that the uncommitted turns were redelivered, so the new worker folds them onto a fresh
    # state (the started event was committed before the stop, so it is not redelivered).
    wait_for(lambda: _seq(projections, "s-down") == 20, timeout=60)
    assert again.alive()


@pytest.mark.plain_stack  # a plaintext service of its own
@pytest.mark.parametrize("first_batch", [False, True], ids=["a later batch", "the first batch"])
def test_a_worker_whose_redis_is_down_stays_live_and_is_not_ready_until_it_is_back(
    settings: Settings,
    kafka_log: KafkaEventLog,
    private_redis: dict[str, Any],
    start_worker: Any,
    first_batch: bool,
) -> None:
    # The first batch of a group that never committed an offset counts too: from offset 0.
    port = free_port()
    s = with_keys(settings, redis_url=private_redis["url"], metrics_port=port, stall_s=3.0)
    worker = start_worker(s)
    projections = RedisProjectionStore.from_url(private_redis["url"], s.redis_keys())
    stuck = [turn("user", f"turn {i}", session_id="s-probed") for i in range(20)]
    if first_batch:
        stuck.insert(0, started("probed", session_id="s-probed"))
    else:
        kafka_log.append(started("probed", session_id="s-probed"))
        wait_for(lambda: projections.load("s-probed") is not None, timeout=60)
    wait_for(lambda: health(port, "/readyz")[0] == 200, timeout=60)
    assert health(port, "/livez")[0] == 200

    private_redis["stop"]()
    for event in stuck:  # a batch the worker cannot commit: it retries Redis
        kafka_log.append(event)
    try:
        wait_for(lambda: health(port, "/readyz")[0] == 503, timeout=30)
    except TimeoutError:
        raise AssertionError(f"{health(port, '/readyz')}\n{worker.log()[-3000:]}") from None
    status, body = health(port, "/readyz")
    # The lag is as of the fetch that brought the stuck batch: the records it holds at least.
    assert status == 503 and body["live"] is True and 0 < body["lag"] <= len(stuck), body
    (problem,) = body["problems"]
    assert problem.startswith(f"{body['lag']} records have waited ")
    assert problem.endswith("with no batch finished")
    assert health(port, "/livez")[0] == 200  # its loop turns: a restart would not bring Redis

    private_redis["start"]()
    wait_for(lambda: health(port, "/readyz")[0] == 200, timeout=60)
    wait_for(lambda: health(port, "/readyz")[1].get("lag") == 0, timeout=60)  # all applied
    assert worker.alive()


def _open(store: SessionStore, sid: str) -> bool:
    session = store.projections.load(sid)
    return session is not None and session.question is not None


def _seq(projections: RedisProjectionStore, sid: str) -> int:
    session = projections.load(sid)
    return -1 if session is None else session.seq
