"""Find or start the local stack; start, watch and stop child processes; small Kafka/Redis helpers.

Shared by the benchmark harness (`bench/`) and the integration tests. Standard library, redis and
kafka-python only: the product's `Settings` stay with the callers, which pass plain environments,
names and addresses.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
from kafka.errors import KafkaError

from deploy.stack import DEFAULT_STATE_DIR, Paths, cluster_nodes, read_json, read_pid

REPO = Path(__file__).resolve().parents[1]
STACK_SCRIPT = Path(__file__).with_name("stack.py")

# -- the stack -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    """Where Kafka and Redis are, and the PIDs of their servers when known (for CPU accounting)."""

    kafka_bootstrap: str
    redis_url: str
    source: str
    kafka_pid: int | None = None
    redis_pid: int | None = None
    redis_cluster_url: str | None = None  # a node of the Redis Cluster (`up --redis-cluster`)
    # A stack of `up --brokers 3 --redis-cluster` (`ensure_cluster_stack`): every broker's PID,
    # every Redis Cluster node's URL and PID, and the replication its topics are made with.
    kafka_pids: tuple[int, ...] = ()
    redis_cluster_nodes: tuple[tuple[str, int], ...] = ()
    replication_factor: int = 1
    min_insync_replicas: int | None = None


def stack_dir() -> Path:
    """deploy/stack.py's state directory: $MILPA_STACK_DIR, else deploy/.run."""
    return Path(os.environ.get("MILPA_STACK_DIR") or DEFAULT_STATE_DIR)


def reachable(bootstrap: str, url: str) -> bool:
    """The first Kafka bootstrap address accepts TCP and Redis answers PING (with ACLs on, a
    refusal to an unauthenticated PING is an answer)."""
    host, _, port = bootstrap.split(",", maxsplit=1)[0].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            pass
        client = redis.Redis.from_url(url, socket_timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.AuthenticationError:
        return True
    except redis.ResponseError as e:
        return "NOAUTH" in str(e)
    except (OSError, ValueError, redis.RedisError):
        return False


def read_env(path: Path) -> dict[str, str]:
    """`NAME=value` lines of an env file such as stack.env ({} when there is none)."""
    if not path.exists():
        return {}
    return dict(
        line.split("=", 1)
        for line in path.read_text().splitlines()
        if "=" in line and line[0] != "#"
    )


def _stack(values: Mapping[str, str], source: str, state: Path) -> Stack | None:
    bootstrap, url = values.get("MILPA_KAFKA_BOOTSTRAP"), values.get("MILPA_REDIS_URL")
    if not bootstrap or not url or not reachable(bootstrap, url):
        return None
    cluster = values.get("MILPA_REDIS_CLUSTER_URLS", "").split(",")[0] or None
    paths = Paths(state)
    brokers = [
        read_pid(paths.kafka_node(int(n["node_id"])).pid)
        for n in cluster_nodes(read_json(paths.kafka_json))
    ]
    nodes = [
        (f"redis://127.0.0.1:{n['port']}", read_pid(paths.redis_node(int(n["index"])).pid))
        for n in cluster_nodes(read_json(paths.redis_cluster_json))
    ]
    min_isr = values.get("MILPA_MIN_INSYNC_REPLICAS")
    return Stack(
        bootstrap,
        url,
        source,
        read_pid(state / "kafka.pid"),
        read_pid(state / "redis.pid"),
        cluster,
        tuple(pid for pid in brokers if pid is not None),
        tuple((node, pid) for node, pid in nodes if pid is not None),
        int(values.get("MILPA_REPLICATION_FACTOR") or 1),
        int(min_isr) if min_isr else None,
    )


def stack_from_environment(state: Path | None = None) -> Stack | None:
    """MILPA_KAFKA_BOOTSTRAP and MILPA_REDIS_URL of this process, if both are set and answer."""
    return _stack(os.environ, "environment", state or stack_dir())


def stack_from_env_file(state: Path | None = None) -> Stack | None:
    """The addresses in deploy/stack.py's stack.env, if they answer."""
    state = state or stack_dir()
    return _stack(read_env(state / "stack.env"), "deploy/stack.py", state)


def stack_command(
    command: str,
    *options: str,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run `deploy/stack.py <command>`; with `check`, a RuntimeError with its output if it fails."""
    done = subprocess.run(
        [sys.executable, str(STACK_SCRIPT), command, *options],
        cwd=REPO,
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"deploy/stack.py {command} failed:\n{done.stdout}\n{done.stderr}")
    return done


def ensure_stack(log: Callable[[str], None]) -> Stack:
    """MILPA_KAFKA_BOOTSTRAP/MILPA_REDIS_URL if set and reachable, else `deploy/stack.py up`.

    `up` is idempotent: it reuses a running stack. Nothing here ever stops the stack.
    """
    found = stack_from_environment()
    if found is not None:
        return found
    log("starting or reusing the local stack: python3 deploy/stack.py up")
    stack_command("up")
    found = stack_from_env_file()
    if found is None:
        raise RuntimeError(
            f"the stack is not reachable after `up` (env file {stack_dir()}/stack.env)"
        )
    return found


def cluster_stack_dir() -> Path:
    """The state directory of the bench's replicated stack: `<stack_dir()>-cluster` (as `./dev
    test --secure` keeps its stack in `<stack_dir()>-secure`)."""
    base = stack_dir()
    return base.with_name(base.name + "-cluster")


CLUSTER_UP = ("up", "--brokers", "3", "--redis-cluster")
"""`deploy/stack.py` arguments of the replicated stack: 3 brokers (RF 3, min.insync.replicas 2)
and a Redis Cluster of 3 masters + 3 replicas."""


def ensure_cluster_stack(log: Callable[[str], None], state: Path | None = None) -> Stack:
    """The replicated stack in `state` (default `cluster_stack_dir()`), started or reused by
    `deploy/stack.py up --brokers 3 --redis-cluster` (idempotent); never stopped here."""
    state = state or cluster_stack_dir()
    log(f"starting or reusing the replicated stack: python3 deploy/stack.py {' '.join(CLUSTER_UP)}")
    stack_command(*CLUSTER_UP, env=stack_dir_env(state), timeout=600)
    found = _stack(read_env(state / "stack.env"), f"deploy/stack.py ({state.name})", state)
    if found is None or found.redis_cluster_url is None or not found.kafka_pids:
        raise RuntimeError(f"the replicated stack is not reachable after `up` ({state}/stack.env)")
    return found


def redis_roles(urls: Sequence[str]) -> dict[str, str]:
    """url -> `master` or `slave` (INFO replication) of each Redis node that answers."""
    out: dict[str, str] = {}
    for url in urls:
        client = redis.Redis.from_url(url, socket_timeout=2)
        try:
            out[url] = str(client.info("replication")["role"])
        except redis.RedisError:
            continue
        finally:
            client.close()
    return out


def stack_dir_env(state: Path) -> dict[str, str]:
    """This environment, with `state` as deploy/stack.py's state directory and no fixed ports (a
    stack of a test's own beside the shared one)."""
    env = {**os.environ, "MILPA_STACK_DIR": str(state)}
    for name in ("MILPA_KAFKA_PORT", "MILPA_KAFKA_CONTROLLER_PORT", "MILPA_REDIS_PORT"):
        env.pop(name, None)
    return env


def kill_broker(state: Path, node: int) -> None:
    """SIGKILL broker `node` of the cluster `stack.py up --brokers 3` started in `state`."""
    stack_command("kill-broker", str(node), env=stack_dir_env(state), timeout=60)


def start_broker(state: Path, node: int, timeout: float = 180.0) -> None:
    """Start broker `node` of that cluster again on its data; returns once it is ready."""
    stack_command("start-broker", str(node), env=stack_dir_env(state), timeout=timeout)


def kill_redis_master(state: Path, node: int | None = None) -> int:
    """SIGKILL a master of the Redis cluster `up --redis-cluster` started in `state` (node
    `node`, or the first master); returns the index of the node killed."""
    done = stack_command(
        "kill-redis-master", *([str(node)] if node else []), env=stack_dir_env(state), timeout=60
    )
    return int(done.stdout.split(":", 1)[0].rsplit("-", 1)[1])


def start_redis_node(state: Path, node: int, timeout: float = 60.0) -> None:
    """Start node `node` of that Redis cluster again (it rejoins, as a replica once its slots
    failed over)."""
    stack_command("start-redis-node", str(node), env=stack_dir_env(state), timeout=timeout)


def server_versions(stack: Stack, state: Path | None = None) -> dict[str, str]:
    """Kafka's version (from deploy/stack.py's state in `state`, default `stack_dir()`, when it
    started it) and Redis's."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError, KeyError):
        kafka = json.loads(((state or stack_dir()) / "kafka.json").read_text())
        out["kafka"] = str(kafka["version"])
    with contextlib.suppress(redis.RedisError):
        client = redis.Redis.from_url(stack.redis_url)
        try:
            out["redis"] = str(client.info("server")["redis_version"])
        finally:
            client.close()
    return out


# -- cleanup ---------------------------------------------------------------------------------------


class Cleanup:
    """Undo actions, run in reverse order; a failing one is reported and the rest still run."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self._actions: list[tuple[str, Callable[[], object]]] = []
        self._log = log

    def push(self, what: str, action: Callable[[], object]) -> None:
        """Register an undo action."""
        self._actions.append((what, action))

    def run(self) -> None:
        """Undo everything registered so far (Ctrl-C during cleanup is deferred to its end)."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            while self._actions:
                what, action = self._actions.pop()
                try:
                    action()
                except Exception as e:  # cleanup must go on
                    self._log(f"cleanup: {what} failed: {type(e).__name__}: {e}")
        finally:
            signal.signal(signal.SIGINT, previous)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Cleanup]:
        """A nested scope: what is registered inside is undone when it exits."""
        inner = Cleanup(self._log)
        try:
            yield inner
        finally:
            inner.run()


def interrupt_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt, so `finally` blocks stop the child processes."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def scratch_dir(cleanup: Cleanup, keep: bool = False) -> Path:
    """A scratch directory for working dirs and logs (removed at cleanup unless kept)."""
    path = Path(tempfile.mkdtemp(prefix="milpa-bench-"))
    if not keep:
        cleanup.push(f"remove {path}", lambda: shutil.rmtree(path, ignore_errors=True))
    return path


# -- child processes -------------------------------------------------------------------------------


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A child process whose output goes to a log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int = 0
    grace: float = 20.0  # how long `stop()` waits before SIGKILL

    @classmethod
    def start(
        cls,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        new_session: bool = False,
        metrics_port: int = 0,
        grace: float = 20.0,
    ) -> Proc:
        """Start `argv` with stdout and stderr to `log_path`.

        `new_session`: its own process group, so Ctrl-C in the terminal reaches the caller only.
        """
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                list(argv),
                env=None if env is None else dict(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                start_new_session=new_session,
            )
        return cls(name, proc, log_path, metrics_port, grace)

    @property
    def pid(self) -> int:
        """Its PID."""
        return self.proc.pid

    def alive(self) -> bool:
        """Still running."""
        return self.proc.poll() is None

    def log(self, tail: int | None = None) -> str:
        """What it printed (the last `tail` characters of it)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text if tail is None else text[-tail:]

    def stop(self, timeout: float | None = None, sig: int = signal.SIGTERM) -> None:
        """`sig` (graceful), SIGKILL if it is still running after `timeout` (its grace)."""
        if self.alive():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=self.grace if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def kill9(self) -> None:
        """Crash it: SIGKILL, no shutdown."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def metrics(self, timeout: float = 5.0) -> str:
        """Its Prometheus exposition ('' without a metrics port)."""
        if not self.metrics_port:
            return ""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body: bytes = response.read()
        return body.decode()


def start_python(
    name: str,
    module: str,
    args: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    **options: Any,
) -> Proc:
    """`python -m <module> <args>`: `env` over this environment, the repository on the path.

    `options`: those of `Proc.start` (cwd, new_session, metrics_port, grace).
    """
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, **(env or {}), "PYTHONPATH": path}
    return Proc.start(name, [sys.executable, "-m", module, *args], log_path, env=env, **options)


def wait_for(
    predicate: Callable[[], object],
    timeout: float = 60.0,
    what: str = "condition",
    interval: float = 0.1,
    procs: Sequence[Proc] = (),
) -> None:
    """Poll until `predicate()`; fail with the processes' logs if one died or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{what}: {p.name} died\n{p.log(4000)}")
        time.sleep(interval)
    logs = "".join(f"\n--- {p.name}\n{p.log(2000)}" for p in procs)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s{logs}")


# -- Kafka and Redis -------------------------------------------------------------------------------


Client = str | Mapping[str, Any]
"""A bootstrap string, or kafka-python client options (`KafkaAccess.kafka_python()`)."""


def _options(client: Client) -> dict[str, Any]:
    return {"bootstrap_servers": client.split(",")} if isinstance(client, str) else dict(client)


def end_offsets(bootstrap: Client, topic: str) -> dict[int, int]:
    """partition → end offset of `topic` ({} when it does not exist)."""
    consumer = KafkaConsumer(**_options(bootstrap), group_id=None)
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        ends = consumer.end_offsets([TopicPartition(topic, p) for p in parts])
        return {tp.partition: off for tp, off in ends.items()}
    finally:
        consumer.close()


def read_topic(bootstrap: Client, topic: str, timeout: float = 60.0) -> Iterator[Any]:
    """Every record of `topic`, from the beginning to the end offsets it had at the start.

    Stops early after `timeout` seconds.
    """
    consumer = KafkaConsumer(**_options(bootstrap), group_id=None, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or set()]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        deadline = time.monotonic() + timeout
        while any(consumer.position(tp) < end for tp, end in ends.items()):
            if time.monotonic() > deadline:
                break
            for batch in consumer.poll(timeout_ms=1000, max_records=5000).values():
                yield from batch
    finally:
        consumer.close()


@dataclass(frozen=True)
class PartitionState:
    """One partition as the cluster describes it now: its leader (-1: none), replicas and ISR."""

    leader: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def partition_states(
    bootstrap: str, topic: str, timeout: float = 20.0
) -> dict[int, PartitionState]:
    """partition → leader, replicas and in-sync replicas of `topic`.

    Asked of the brokers of the `bootstrap` list that accept connections, in turn, until one
    answers within `timeout`: while a killed broker is still in the cluster's metadata,
    kafka-python's admin may send its request there and fail instead of trying another.
    """
    described: dict[str, Any] | None = None
    error: Exception | None = None
    deadline = time.monotonic() + timeout
    while described is None:
        for address in (a for a in bootstrap.split(",") if _answers(a)):
            try:
                admin = KafkaAdminClient(
                    bootstrap_servers=[address],
                    request_timeout_ms=5000,
                    bootstrap_timeout_ms=5000,
                )
            except KafkaError as e:
                error = e
                continue
            try:
                (described,) = admin.describe_topics([topic])
                break
            except KafkaError as e:
                error = e
            finally:
                admin.close()
        if described is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no broker of {bootstrap} described {topic}: {error}")
            time.sleep(0.2)
    return {
        p["partition_index"]: PartitionState(
            int(p["leader_id"]), tuple(p["replica_nodes"]), tuple(p["isr_nodes"])
        )
        for p in described["partitions"]
    }


def topic_config(bootstrap: Client, topic: str) -> dict[str, tuple[str, str]]:
    """name → (value, source) of every configuration of `topic` (source: DYNAMIC_TOPIC_CONFIG
    when set on the topic, DEFAULT_CONFIG or a broker's when inherited)."""
    admin = KafkaAdminClient(**_options(bootstrap))
    try:
        reply = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        admin.close()
    configs = reply["topic"][topic]
    return {name: (str(c["value"]), str(c["config_source"])) for name, c in configs.items()}


def _scan(client: redis.Redis, pattern: str, size: int = 5000) -> Iterator[list[bytes]]:
    """The keys matching the SCAN `pattern`, in lists of up to `size`."""
    batch: list[bytes] = []
    for key in client.scan_iter(match=pattern, count=size):
        batch.append(key)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def unlink_matching(url: str, pattern: str) -> int:
    """Unlink every Redis key matching the SCAN `pattern`; returns how many."""
    client = redis.Redis.from_url(url)
    try:
        return sum(client.unlink(*batch) for batch in _scan(client, pattern))
    finally:
        client.close()


def memory_usage(client: redis.Redis, pattern: str) -> Iterator[tuple[bytes, int]]:
    """(key, MEMORY USAGE in bytes) of every key matching the SCAN `pattern`."""
    for batch in _scan(client, pattern):
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.memory_usage(key, samples=0)
        for key, used in zip(batch, pipe.execute(), strict=True):
            yield key, int(used or 0)
