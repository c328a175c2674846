"""Fixtures for tests against a real Kafka broker and a real Redis.

Where the services come from, in order: MILPA_KAFKA_BOOTSTRAP + MILPA_REDIS_URL from the environment
(`./dev test` exports them after `deploy/stack.py up`), the local stack's env file, or
testcontainers when a Docker engine answers. With MILPA_REQUIRE_SERVICES=1 (CI) a missing service
fails the run instead of skipping it. Every test gets its own topics, consumer group and Redis key
prefix, so tests never see each other's data.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient
from kafka.errors import (
    CoordinatorLoadInProgressError,
    CoordinatorNotAvailableError,
    NotCoordinatorError,
)
from kafka.net import inet

from deploy.harness import (
    REPO,
    Proc,
    Stack,
    stack_from_env_file,
    stack_from_environment,
    start_python,
)
from milpa_sessions.settings import Settings
from producers.acls import Principals, apply_acls
from producers.kafka_log import KafkaEventLog
from producers.store import SessionStore
from producers.topics import delete_topics, ensure_topics
from projections.redis_store import RedisProjectionStore
from schemas.errors import LogError
from schemas.events import Event

# Fixtures of their own modules, offered to every test here.
from tests.integration.console_support import console_stack  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def _close_abandoned_sockets() -> Iterator[None]:
    """kafka-python 3.0.12 drops the socket of a connect that fails or is abandoned unclosed
    (`kafka.net.inet.KafkaNetSocket.sock_connect` raises, or its coroutine is cancelled or closed
    by a client shutting down mid-connect, without closing it). The garbage collector then finds
    it during whichever test runs next, and warnings-as-errors fail that test (seen in CI: a
    connected socket collected in an unrelated test). Close them as the library should, for the
    whole run, since clients' network threads outlive a test's own patches."""
    original = inet.KafkaNetSocket.sock_connect

    async def sock_connect(
        self: Any, net: Any, sock: socket.socket, sockaddr: Any, timeout_at: Any = None
    ) -> Any:
        try:
            return await original(self, net, sock, sockaddr, timeout_at=timeout_at)
        except BaseException:  # refused, timed out, cancelled or closed (GeneratorExit)
            sock.close()
            raise

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inet.KafkaNetSocket, "sock_connect", sock_connect)
        yield


def _docker_answers() -> bool:
    try:
        import docker  # noqa: PLC0415 - optional dependency

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The real Kafka broker and Redis for this test run."""
    found = stack_from_environment() or stack_from_env_file()
    if found is not None:
        yield found
        return
    if _docker_answers():
        from testcontainers.kafka import KafkaContainer  # noqa: PLC0415
        from testcontainers.redis import RedisContainer  # noqa: PLC0415

        with KafkaContainer().with_kraft() as kafka, RedisContainer() as rc:
            port = rc.get_exposed_port(rc.port)
            yield Stack(
                kafka.get_bootstrap_server(),
                f"redis://{rc.get_container_host_ip()}:{port}/0",
                "testcontainers",
            )
        return
    message = (
        "no Kafka/Redis: run `python3 deploy/stack.py up` (or `./dev test`), "
        "or set MILPA_KAFKA_BOOTSTRAP and MILPA_REDIS_URL"
    )
    if os.environ.get("MILPA_REQUIRE_SERVICES") == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def redis_cluster_url(stack: Stack) -> str:
    """A node of the stack's Redis Cluster (3 masters + 3 replicas: `deploy/stack.py up
    --redis-cluster`, which `./dev test` starts)."""
    if stack.redis_cluster_url is None:
        message = "no Redis Cluster: run `python3 deploy/stack.py up --redis-cluster`"
        if os.environ.get("MILPA_REQUIRE_SERVICES") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return stack.redis_cluster_url


# How this run reaches the stack beyond its addresses: on a secured stack (`./dev test --secure`),
# the test principal's Kafka and Redis credentials; topics and ACLs are made by the admin.
SECURITY_FIELDS = (
    "kafka_security_protocol",
    "kafka_sasl_mechanism",
    "kafka_username",
    "kafka_password_file",
    "kafka_ca_file",
    "redis_username",
    "redis_password_file",
    "redis_ca_file",
)


@pytest.fixture(scope="session")
def secured(stack: Stack) -> Settings:
    """The stack's addresses and this run's credentials (none on a plaintext stack)."""
    env = {
        k: v for k, v in os.environ.items() if k.removeprefix("MILPA_").lower() in SECURITY_FIELDS
    }
    return Settings.from_env(env, kafka_bootstrap=stack.kafka_bootstrap, redis_url=stack.redis_url)


def _as_admin(s: Settings) -> Settings:
    """`s` with the administrator's Kafka credentials (to create topics and ACLs)."""
    user = os.environ.get("MILPA_TEST_KAFKA_ADMIN", "admin")
    secret = os.environ.get("MILPA_TEST_KAFKA_ADMIN_PASSWORD_FILE")
    if secret is None:
        pytest.fail("a SASL stack needs MILPA_TEST_KAFKA_ADMIN_PASSWORD_FILE", pytrace=False)
    return replace(s, kafka_username=user, kafka_password_file=Path(secret))


@pytest.fixture
def settings(secured: Settings) -> Iterator[Settings]:
    """Settings with topics, group and key prefix of this test alone (topics created, then deleted).

    Deleted at teardown, after the test's workers stopped: a long-lived local broker would
    otherwise keep four topics per test run (hundreds after a few runs of the suite).
    """
    tag = uuid.uuid4().hex[:10]
    s = replace(
        secured,
        redis_prefix=f"it{tag}",
        events_topic=f"it-{tag}-events",
        decisions_topic=f"it-{tag}-decisions",
        questions_topic=f"it-{tag}-questions",
        deadletter_topic=f"it-{tag}-deadletter",
        snapshots_topic=f"it-{tag}-snapshots",
        consumer_group=f"it-{tag}-projector",
        partitions=6,
        read_timeout=60.0,
    )
    admin = _as_admin(s) if s.kafka_access().sasl else s
    ensure_topics(admin)
    if admin is not s:  # the test principal plays every role, on this test's resources only
        me = s.kafka_username
        # Returns once the broker enforces them: the test's first request is never refused.
        apply_acls(admin, Principals(agent=me, worker=me, operator=me))
    yield s
    try:
        delete_topics(admin)
    except LogError as e:  # the test's outcome stands; the leftovers are only clutter
        warnings.warn(f"could not delete the test's topics: {e}", stacklevel=1)


@pytest.fixture
def projections(settings: Settings) -> Iterator[RedisProjectionStore]:
    """The Redis projection store under this test's prefix (cleared afterwards)."""
    store = RedisProjectionStore.from_url(
        settings.redis_url, settings.redis_keys(), auth=settings.redis_auth()
    )
    yield store
    store.clear()
    store.client.close()


@pytest.fixture
def kafka_log(settings: Settings) -> Iterator[KafkaEventLog]:
    """A producer on this test's events topic."""
    log = KafkaEventLog(settings.kafka_access(), settings.events_topic)
    yield log
    log.close()


@pytest.fixture
def raw_producer(settings: Settings) -> Iterator[KafkaProducer]:
    """A plain kafka-python producer: it writes whatever bytes it is given, where it is told."""
    producer = KafkaProducer(**settings.kafka_access().kafka_python(), acks="all")
    yield producer
    producer.close(timeout=10)


@pytest.fixture
def kafka_store(kafka_log: KafkaEventLog, projections: RedisProjectionStore) -> SessionStore:
    """A SessionStore that writes to Kafka and reads the Redis projections."""
    return SessionStore(kafka_log, projections, producer="it-agent", read_timeout=60.0)


def run_cli(
    settings: Settings, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`milpa-sessions --json ARGS` in a process of its own, with these settings.

    One that outlives `timeout` fails the test with every thread's stack of each of its processes
    (forked rebuild processes too): SIGABRT to its process group, which faulthandler prints.
    """
    command = [sys.executable, "-m", "milpa_sessions.cli", "--json", *args]
    env = {**os.environ, **settings.to_env(), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(
        command,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGABRT)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # the dumps did not end it: what they printed
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            pytest.fail(
                f"milpa-sessions {' '.join(args)} did not end within {timeout:g}s; its stacks:\n"
                f"{err[-20000:]}\n(stdout: {out[-2000:]})",
                pytrace=False,
            )
        finally:  # also on the test's own timeout or Ctrl-C: nothing of it is left running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.fixture
def start_worker(settings: Settings, tmp_path: Path) -> Iterator[object]:
    """Start worker (or scheduler) processes for this test's settings; stopped at teardown."""
    started: list[Proc] = []

    def start(
        extra: Settings | None = None, command: str = "worker", module: str = "milpa_sessions.cli"
    ) -> Proc:
        worker = start_python(
            command,
            module,  # the CLI, or a test's variant of it (`buggy_worker`)
            [command, "--loglevel", "info"],
            tmp_path / f"{command}-{len(started)}.log",
            env=(extra or settings).to_env(),
            cwd=tmp_path,  # Faust's data directory goes there, not into the checkout
            grace=30.0,
        )
        started.append(worker)
        return worker

    yield start
    for w in started:
        w.stop()


def with_keys(settings: Settings, **changes: object) -> Settings:
    """A copy of `settings` with some fields changed."""
    return replace(settings, **changes)  # type: ignore[arg-type]


class PacedProducer(threading.Thread):
    """Sends `events` in chunks spread evenly over `seconds`, then flushes; keeps every future."""

    CHUNK = 100

    def __init__(self, log: KafkaEventLog, events: Sequence[Event], seconds: float) -> None:
        super().__init__(name="paced-producer", daemon=True)
        self.log, self.events, self.seconds = log, events, seconds
        self.futures: list[tuple[Event, Any]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            starts = range(0, len(self.events), self.CHUNK)
            t0 = time.monotonic()
            for i, start in enumerate(starts):
                for event in self.events[start : start + self.CHUNK]:
                    self.futures.append((event, self.log.send(event)))
                time.sleep(max(0.0, t0 + (i + 1) * self.seconds / len(starts) - time.monotonic()))
            self.log.flush(timeout=180)
        except BaseException as e:
            self.error = e

    @classmethod
    def sent_after(cls, index: int, count: int, seconds: float) -> float:
        """About how many seconds after the start the event at `index` of `count` is sent."""
        chunks = -(-count // cls.CHUNK)
        return (index // cls.CHUNK) * seconds / chunks

    def acked(self) -> int:
        """How many appends the broker acknowledged so far."""
        return sum(1 for _, f in list(self.futures) if f.is_done and f.succeeded())


def health(port: int, path: str) -> tuple[int, dict[str, Any]]:
    """A health endpoint's status and JSON body (0 and {} while nothing listens there)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, ConnectionError):
        return 0, {}


def committed_offsets(settings: Settings) -> dict[int, int]:
    """partition → the group's committed offset on the events topic (next record to read);
    none while the broker has no coordinator for the group yet (a broker just started: it may
    answer any of these, which a caller polling `wait_for` asks again after)."""
    admin = KafkaAdminClient(**settings.kafka_access().kafka_python())
    try:
        offsets = admin.list_group_offsets({settings.consumer_group: None})
    except (CoordinatorNotAvailableError, NotCoordinatorError, CoordinatorLoadInProgressError):
        return {}
    finally:
        admin.close()
    return {
        tp.partition: meta.offset
        for tp, meta in offsets.get(settings.consumer_group, {}).items()
        if tp.topic == settings.events_topic
    }


def damage_state(store: RedisProjectionStore, session_id: str) -> None:
    """Give the session's stored state a layout byte no reader knows (layout 9)."""
    key = store.keys.session(session_id).state
    fields = store.client.hgetall(key)
    (name,) = [f for f in (b"s", b"s1") if f in fields]
    store.client.hset(key, name, b"\x09" + fields[name][1:])
