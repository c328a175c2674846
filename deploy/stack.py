#!/usr/bin/env python3
"""Local stack manager for milpa-sessions: a real Kafka broker + a real redis-server.

    python3 deploy/stack.py up|down|status|env [--state-dir DIR] [--export]
    python3 deploy/stack.py up --brokers 3 [--redis-cluster]
    python3 deploy/stack.py kill-broker N | start-broker N | kill-redis-master | start-redis-node N

* Kafka: single node, KRaft, combined broker+controller, run with the machine's Java from jars
  that Maven resolves from Maven Central (deploy/kafka/pom.xml) into a per-version cache.
  `--brokers 3`: three such nodes, a 3-voter controller quorum, replication factor 3 and
  min.insync.replicas 2 (files kafka-<n>.*); `kill-broker N` / `start-broker N` crash one with
  SIGKILL and start it again on its data.
* Redis: Debian's redis-server (installed with apt-get when missing and running as root).
  `--redis-cluster`: also 3 masters + 3 replicas with --cluster-enabled (files redis-cluster-<i>.*),
  beside the single redis-server that MILPA_REDIS_URL names.
* All listen on 127.0.0.1 on free ports (or MILPA_KAFKA_PORT / MILPA_REDIS_PORT, single node).
* State (pids, ports, logs, fresh Kafka log.dirs, stack.env) lives in deploy/.run/
  (override: --state-dir or MILPA_STACK_DIR).

Standard library only: this runs before any virtualenv exists.

Environment overrides:
    MILPA_STACK_DIR            state directory (default: deploy/.run)
    MILPA_KAFKA_VERSION        Kafka version to resolve and run (default: KAFKA_VERSION below)
    MILPA_KAFKA_PORT           PLAINTEXT port (default: a free port)
    MILPA_KAFKA_CONTROLLER_PORT  CONTROLLER port (default: a free port)
    MILPA_REDIS_PORT           redis port (default: a free port)
    MILPA_CACHE_DIR            jar cache root (default: ~/.cache/milpa-sessions)
    MILPA_KAFKA_READY_TIMEOUT  seconds to wait for "Kafka Server started" (default: 90)
    JAVA_HOME                  Java to use (default: `java` on PATH)

Exit codes: 0 ok; 1 a service failed to start / is not up; 2 missing prerequisite, bad
configuration or a requested port already in use.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import functools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Kafka release to run. 4.3.1 was verified here with BOTH Python clients we use (kafka-python
# 3.0.12 and aiokafka 0.14.0 / faust-streaming 0.15.3); 3.9.1, 4.1.2, 4.2.2 and 4.4.0 also passed.
# Override per run with MILPA_KAFKA_VERSION (3.3+; 3.x gets reload4j, 4.x gets log4j2).
KAFKA_VERSION = "4.3.1"

DEPLOY_DIR = Path(__file__).resolve().parent
POM = DEPLOY_DIR / "kafka" / "pom.xml"
DEFAULT_STATE_DIR = DEPLOY_DIR / ".run"
KAFKA_READY_MARKER = "Kafka Server started"
KAFKA_JVM_HEAP = ["-Xms256m", "-Xmx768m"]
REDIS_READY_TIMEOUT = 20.0
KAFKA_STOP_TIMEOUT = 30.0
REDIS_STOP_TIMEOUT = 10.0
LIB_MARKER = ".milpa-resolved"
TAIL_LINES = 40
# --brokers 3: topics and internal topics replicated to every broker, a write acknowledged by two.
CLUSTER_SIZES = (1, 3)
CLUSTER_MIN_INSYNC = 2
# A broker killed with -9 is fenced (its partitions led elsewhere, it leaves their ISRs) once it
# has missed heartbeats for this long (Kafka's default is 9 s).
BROKER_SESSION_TIMEOUT_MS = 6000
BROKER_HEARTBEAT_INTERVAL_MS = 1000
# --redis-cluster: 3 masters, one replica each; a master unreachable this long is failed over.
REDIS_CLUSTER_NODES = 6
REDIS_CLUSTER_REPLICAS = 1
REDIS_CLUSTER_NODE_TIMEOUT_MS = 3000
REDIS_CLUSTER_READY_TIMEOUT = 60.0


class StackError(Exception):
    """A one-line error for the user; `log` (optional) is a file whose tail is printed."""

    def __init__(self, message: str, code: int = 1, log: Path | None = None, output: str = ""):
        super().__init__(message)
        self.code = code
        self.log = log
        self.output = output


def info(msg: str) -> None:
    print(f"stack: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- helpers


def env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise StackError(f"{name}={raw!r} is not a valid TCP port", code=2)
    return int(raw)


def tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(lines[-n:])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed process that nobody has reaped yet still answers kill(0): treat zombies as dead.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False
    except (OSError, IndexError):
        pass
    return True


def pid_cmdline(pid: int) -> str | None:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return None  # no /proc (or gone): cannot tell


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def port_open(port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def redis_ping(port: int, timeout: float = 1.0) -> bool:
    """Whether a redis-server answers on `port` (with ACLs on, a refusal to a stranger counts)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def pick_ports(requests: list[tuple[str, int | None]]) -> list[int]:
    """Return one port per (env name, requested port); requested ports must be free."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for name, wanted in requests:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.append(s)
            if wanted is not None:
                if port_open(wanted, timeout=0.5):
                    raise StackError(
                        f"port {wanted} ({name}) is already in use on 127.0.0.1", code=2
                    )
                try:
                    s.bind(("127.0.0.1", wanted))
                except OSError as exc:
                    raise StackError(
                        f"port {wanted} ({name}) is not available: {exc.strerror}", code=2
                    ) from None
            else:
                s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    finally:
        for s in held:
            s.close()
    return ports


def stop_pid(pid: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> bool:
    """SIGTERM, wait up to `timeout`, then SIGKILL. Returns True if it had to SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        if not pid_alive(pid):
            return False
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pid_alive(pid):
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    return True


def stop_pids(pids: list[int], timeout: float) -> set[int]:
    """SIGTERM all of them at once, wait up to `timeout`, SIGKILL the rest; returns those killed."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in pids):
        time.sleep(0.2)
    killed = {pid for pid in pids if pid_alive(pid)}
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in killed):
        time.sleep(0.1)
    return killed


@contextlib.contextmanager
def state_lock(state_dir: Path) -> Iterator[None]:
    with open(state_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- service state


@dataclass
class Status:
    state: str  # "up" | "down" | "unhealthy"
    pid: int | None = None
    port: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class KafkaNode:
    """One broker's files: the single node's (kafka.pid, kafka.log, kafka/) or those of node `n`
    of a cluster (kafka-<n>.pid, kafka-<n>.log, kafka-<n>/)."""

    node_id: int
    label: str
    pid: Path
    log: Path
    dir: Path

    @property
    def props(self) -> Path:
        return self.dir / "server.properties"

    @property
    def data(self) -> Path:
        return self.dir / "data"


@dataclass(frozen=True)
class RedisNode:
    """One node of the Redis cluster: redis-cluster-<i>.pid, redis-cluster-<i>.log and its
    directory redis-cluster-<i>/ (nodes.conf)."""

    index: int
    label: str
    pid: Path
    log: Path
    dir: Path


class Paths:
    def __init__(self, state_dir: Path):
        self.dir = state_dir
        self.env = state_dir / "stack.env"
        self.kafka_pid = state_dir / "kafka.pid"
        self.kafka_json = state_dir / "kafka.json"  # the single node's, or the cluster's nodes
        self.kafka_log = state_dir / "kafka.log"
        self.kafka_dir = state_dir / "kafka"
        self.kafka_props = self.kafka_dir / "server.properties"
        self.kafka_data = self.kafka_dir / "data"
        self.redis_pid = state_dir / "redis.pid"
        self.redis_json = state_dir / "redis.json"
        self.redis_log = state_dir / "redis.log"
        self.redis_cluster_json = state_dir / "redis-cluster.json"
        self.redis_cluster_log = state_dir / "redis-cluster.log"  # `redis-cli --cluster create`
        self.maven_log = state_dir / "maven.log"
        self.secure = state_dir / "secure"  # --secure: keystores, the CA, one password per user
        self.apt_log = state_dir / "apt.log"

    def kafka_single(self) -> KafkaNode:
        return KafkaNode(1, "kafka", self.kafka_pid, self.kafka_log, self.kafka_dir)

    def kafka_node(self, n: int) -> KafkaNode:
        d = self.dir
        return KafkaNode(
            n, f"kafka-{n}", d / f"kafka-{n}.pid", d / f"kafka-{n}.log", d / f"kafka-{n}"
        )

    def redis_node(self, i: int) -> RedisNode:
        d, name = self.dir, f"redis-cluster-{i}"
        return RedisNode(i, name, d / f"{name}.pid", d / f"{name}.log", d / name)


def node_status(node: KafkaNode, port: int | None) -> Status:
    pid = read_pid(node.pid)
    if pid is None or not pid_alive(pid):
        return Status("down", detail="not running")
    cmd = pid_cmdline(pid)
    if cmd is not None and ("kafka.Kafka" not in cmd or str(node.props) not in cmd):
        return Status("down", detail=f"pid {pid} is not our broker (stale pid file)")
    if not port:
        return Status("unhealthy", pid, None, f"pid {pid} alive but kafka.json is missing")
    try:
        started = KAFKA_READY_MARKER in node.log.read_text(errors="replace")
    except OSError:
        started = False
    if not started:
        return Status(
            "unhealthy", pid, port, f"pid {pid} alive but the log has no '{KAFKA_READY_MARKER}'"
        )
    if not port_open(port):
        return Status(
            "unhealthy", pid, port, f"pid {pid} alive but 127.0.0.1:{port} refuses connections"
        )
    return Status("up", pid, port)


def kafka_status(p: Paths) -> Status:
    """The single node's state."""
    return node_status(p.kafka_single(), read_json(p.kafka_json).get("port"))


def cluster_nodes(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes kafka.json lists when it describes a cluster ([] for a single node)."""
    nodes = meta.get("nodes")
    return [n for n in nodes if isinstance(n, dict)] if isinstance(nodes, list) else []


def kafka_layout(p: Paths) -> list[tuple[KafkaNode, Status]]:
    """Every broker kafka.json describes (the single node, or each node of the cluster)."""
    nodes = cluster_nodes(read_json(p.kafka_json))
    if not nodes:
        return [(p.kafka_single(), kafka_status(p))]
    out = []
    for n in nodes:
        node = p.kafka_node(int(n["node_id"]))
        out.append((node, node_status(node, n.get("port"))))
    return out


def _redis_status(pidfile: Path, port: int | None, what: str) -> Status:
    pid = read_pid(pidfile)
    if pid is None or not pid_alive(pid):
        return Status("down", detail="not running")
    cmd = pid_cmdline(pid)
    if cmd is not None and ("redis-server" not in cmd or (port and f":{port}" not in cmd)):
        return Status("down", detail=f"pid {pid} is not our redis-server (stale pid file)")
    if not port:
        return Status("unhealthy", pid, None, f"pid {pid} alive but {what} is missing")
    if not redis_ping(port):
        return Status(
            "unhealthy", pid, port, f"pid {pid} alive but 127.0.0.1:{port} does not answer PING"
        )
    return Status("up", pid, port)


def redis_status(p: Paths) -> Status:
    return _redis_status(p.redis_pid, read_json(p.redis_json).get("port"), p.redis_json.name)


def redis_cluster_layout(p: Paths) -> list[tuple[RedisNode, dict[str, Any], Status]]:
    """Every node redis-cluster.json describes, its ports and its state ([] without a cluster)."""
    out = []
    for n in cluster_nodes(read_json(p.redis_cluster_json)):
        node = p.redis_node(int(n["index"]))
        out.append((node, n, _redis_status(node.pid, n.get("port"), p.redis_cluster_json.name)))
    return out


def redis_cluster_urls(p: Paths) -> str:
    nodes = cluster_nodes(read_json(p.redis_cluster_json))
    return ",".join(f"redis://127.0.0.1:{n['port']}" for n in nodes)


def env_lines(p: Paths, redis_cluster: bool = False) -> list[str]:
    kafka = read_json(p.kafka_json)
    redis = read_json(p.redis_json)
    rport = redis["port"]
    nodes = cluster_nodes(kafka)
    if nodes:
        bootstrap = ",".join(f"127.0.0.1:{n['port']}" for n in nodes)
    else:
        bootstrap = f"127.0.0.1:{kafka['port']}"
    lines = [
        f"MILPA_KAFKA_BOOTSTRAP={bootstrap}",
        f"MILPA_REDIS_URL=redis://127.0.0.1:{rport}/0",
    ]
    if nodes:
        # Topics as the cluster is meant to run them (producers/settings.py reads these).
        lines += [
            f"MILPA_REPLICATION_FACTOR={kafka['replication_factor']}",
            f"MILPA_MIN_INSYNC_REPLICAS={kafka['min_insync_replicas']}",
        ]
    if redis_cluster:
        lines.append(f"MILPA_REDIS_CLUSTER_URLS={redis_cluster_urls(p)}")
    if kafka.get("secure"):
        # As the operator; other users' passwords are in secure/<user>.password.
        lines += [
            "MILPA_KAFKA_SECURITY_PROTOCOL=SASL_SSL",
            "MILPA_KAFKA_SASL_MECHANISM=SCRAM-SHA-512",
            f"MILPA_KAFKA_CA_FILE={p.secure / 'ca.pem'}",
            "MILPA_KAFKA_USERNAME=operator",
            f"MILPA_KAFKA_PASSWORD_FILE={p.secure / 'operator.password'}",
        ]
    if redis.get("secure"):
        lines += [
            "MILPA_REDIS_USERNAME=operator",
            f"MILPA_REDIS_PASSWORD_FILE={p.secure / 'redis-operator.password'}",
        ]
    return lines


def print_env(lines: list[str], export: bool) -> None:
    for line in lines:
        print(f"export {line}" if export else line)


# --------------------------------------------------------------------------- prerequisites


def kafka_version() -> str:
    version = os.environ.get("MILPA_KAFKA_VERSION", "").strip() or KAFKA_VERSION
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        raise StackError(
            f"MILPA_KAFKA_VERSION={version!r} is not a release version like 3.9.1", code=2
        )
    if (int(m[1]), int(m[2])) < (3, 3):
        raise StackError(
            f"Kafka {version} is too old for a KRaft combined node (need >= 3.3)", code=2
        )
    return version


def kafka_major(version: str) -> int:
    return int(version.split(".", maxsplit=1)[0])


def find_java(version: str) -> str:
    java_home = os.environ.get("JAVA_HOME")
    java = None
    if java_home and (Path(java_home) / "bin" / "java").exists():
        java = str(Path(java_home) / "bin" / "java")
    java = java or shutil.which("java")
    if not java:
        raise StackError(
            "java not found: install a JDK >= 17 (e.g. apt-get install -y openjdk-17-jdk-headless)",
            code=2,
        )
    try:
        out = subprocess.run(
            [java, "-version"], check=False, capture_output=True, text=True, timeout=30
        ).stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StackError(f"cannot run {java} -version: {exc}", code=2) from None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if m:
        major = int(m[2]) if m[1] == "1" else int(m[1])
        need = 17 if kafka_major(version) >= 4 else 11
        if major < need:
            raise StackError(
                f"{java} is Java {major}; Kafka {version} needs Java >= {need}", code=2
            )
    return java


def lib_dir(version: str) -> Path:
    root = os.environ.get("MILPA_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "milpa-sessions"
    )
    return Path(root).expanduser() / f"kafka-{version}" / "lib"


def libs_ready(lib: Path, version: str) -> bool:
    return (lib / LIB_MARKER).exists() and (lib / f"kafka_2.13-{version}.jar").exists()


def ensure_kafka_libs(p: Paths, version: str) -> Path:
    lib = lib_dir(version)
    if libs_ready(lib, version):
        return lib
    mvn = shutil.which("mvn")
    if not mvn:
        raise StackError(
            "mvn not found: install Maven (apt-get install -y maven) to resolve the Kafka jars",
            code=2,
        )
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.parent / f"lib.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    profile = "kafka4" if kafka_major(version) >= 4 else "kafka3"
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(POM),
        f"-P{profile}",
        f"-Dkafka.version={version}",
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={tmp}",
    ]
    info(f"resolving Kafka {version} jars with Maven into {lib} (first run only) ...")
    t0 = time.monotonic()
    with open(p.maven_log, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(
            cmd, check=False, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        ).returncode
    if rc != 0 or not (tmp / f"kafka_2.13-{version}.jar").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            lib.parent.rmdir()  # only if empty (a bad version must not leave a cache dir behind)
        raise StackError(
            f"Maven could not resolve Kafka {version} (exit {rc}); see {p.maven_log}",
            log=p.maven_log,
        )
    (tmp / LIB_MARKER).write_text(
        f"kafka {version} resolved {time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
    )
    shutil.rmtree(lib, ignore_errors=True)
    tmp.replace(lib)
    info(f"resolved {len(list(lib.glob('*.jar')))} jars in {time.monotonic() - t0:.1f}s")
    return lib


def find_redis(p: Paths) -> str:
    found = shutil.which("redis-server") or next(
        (c for c in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if os.access(c, os.X_OK)),
        None,
    )
    if found:
        return found
    hint = "apt-get update && apt-get install -y redis-server"
    if os.geteuid() != 0:
        raise StackError(f"redis-server not found; install it with: sudo sh -c '{hint}'", code=2)
    if not shutil.which("apt-get"):
        raise StackError(
            "redis-server not found and apt-get is unavailable; install redis-server (>= 6)", code=2
        )
    info("redis-server not found: installing Debian's redis-server with apt-get ...")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    with open(p.apt_log, "w") as log:
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "redis-server"]):
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            rc = subprocess.run(
                cmd,
                check=False,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            ).returncode
            if rc != 0:
                raise StackError(
                    f"'{' '.join(cmd)}' failed (exit {rc}); see {p.apt_log}", code=2, log=p.apt_log
                )
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )
    if not found:
        raise StackError(
            f"redis-server still not found after apt-get install; see {p.apt_log}",
            code=2,
            log=p.apt_log,
        )
    return found


# --------------------------------------------------------------------------- start


def new_cluster_id() -> str:
    while True:
        cid = base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def kafka_properties(
    port: int,
    cport: int,
    data: Path,
    version: str,
    secure: dict[str, str] | None = None,
    *,
    node_id: int = 1,
    voters: str | None = None,
    replicas: int = 1,
) -> str:
    """One node's server.properties: the single node by default; a cluster's node `node_id` with
    the quorum's `voters` and every topic on `replicas` brokers (see `cluster_properties`)."""
    client = "SASL_SSL" if secure else "PLAINTEXT"
    min_isr = min(replicas, CLUSTER_MIN_INSYNC)
    props = [
        "process.roles=broker,controller",
        f"node.id={node_id}",
        f"controller.quorum.voters={voters or f'1@127.0.0.1:{cport}'}",
        f"listeners={client}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
        f"advertised.listeners={client}://127.0.0.1:{port}",
        "controller.listener.names=CONTROLLER",
        f"inter.broker.listener.name={client}",
        f"listener.security.protocol.map=CONTROLLER:PLAINTEXT,{client}:{client}",
        f"offsets.topic.replication.factor={replicas}",
        f"transaction.state.log.replication.factor={replicas}",
        f"transaction.state.log.min.isr={min_isr}",
        "group.initial.rebalance.delay.ms=0",
        "num.partitions=6",
        "auto.create.topics.enable=false",
        f"log.dirs={data}",
    ]
    if replicas > 1:
        props += [
            f"default.replication.factor={replicas}",
            f"min.insync.replicas={min_isr}",
            f"broker.session.timeout.ms={BROKER_SESSION_TIMEOUT_MS}",
            f"broker.heartbeat.interval.ms={BROKER_HEARTBEAT_INTERVAL_MS}",
        ]
    if kafka_major(version) >= 4:
        props += [
            f"share.coordinator.state.topic.replication.factor={replicas}",
            f"share.coordinator.state.topic.min.isr={min_isr}",
        ]
    if secure:
        # Clients and the broker itself speak SASL/SCRAM over TLS; ACLs decide what each user may
        # do. The controller listener stays PLAINTEXT on loopback (KRaft cannot authenticate it
        # with SCRAM: the credentials live in the metadata it serves), hence User:ANONYMOUS among
        # the super users: use mTLS for it where the controller port is reachable by others.
        props += [
            "sasl.enabled.mechanisms=SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config="
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="admin" password="{secure["admin"]}";',
            f"ssl.keystore.location={secure['keystore']}",
            "ssl.keystore.type=PKCS12",
            f"ssl.keystore.password={secure['store_password']}",
            f"ssl.key.password={secure['store_password']}",
            f"ssl.truststore.location={secure['truststore']}",
            "ssl.truststore.type=PKCS12",
            f"ssl.truststore.password={secure['store_password']}",
            "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users=User:admin;User:ANONYMOUS",
            "allow.everyone.if.no.acl.found=false",
        ]
    return "# generated by deploy/stack.py; rewritten on every start\n" + "\n".join(props) + "\n"


def cluster_properties(
    ports: list[tuple[int, int]], data_dirs: list[Path], version: str
) -> list[str]:
    """server.properties of each node of a cluster: node i+1 listens on ports[i] (client,
    controller) and keeps its log in data_dirs[i]; every node is a voter of the controller quorum,
    and topics are replicated to (at most) 3 brokers, of which 2 must acknowledge a write."""
    if len(ports) != len(data_dirs) or len(ports) < 1:
        raise ValueError("one (port, controller port) pair and one data dir per node")
    voters = ",".join(f"{i}@127.0.0.1:{cport}" for i, (_, cport) in enumerate(ports, 1))
    replicas = min(len(ports), 3)
    return [
        kafka_properties(port, cport, data, version, node_id=i, voters=voters, replicas=replicas)
        for i, ((port, cport), data) in enumerate(zip(ports, data_dirs, strict=True), 1)
    ]


SCRAM_USERS = ("admin", "agent", "worker", "operator")


def secure_material(p: Paths, java: str) -> dict[str, str]:
    """--secure: a throwaway self-signed CA/broker certificate and one password per SCRAM user.

    Made once per state directory (reused by later starts), with the JDK's keytool. The
    certificate names 127.0.0.1 and localhost; clients trust `ca.pem`. Files are private (0600).
    """
    d = p.secure
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    material = {
        "keystore": str(d / "broker.p12"),
        "truststore": str(d / "trust.p12"),
        "ca": str(d / "ca.pem"),
    }
    for name in ("store", *SCRAM_USERS):
        path = d / f"{name}.password"
        if not path.exists():
            path.write_text(secrets.token_hex(16) + "\n")
            path.chmod(0o600)
        key = "store_password" if name == "store" else name
        material[key] = path.read_text().strip()
    if not Path(material["truststore"]).exists():
        keytool = str(Path(os.path.realpath(java)).parent / "keytool")
        keytool = keytool if os.access(keytool, os.X_OK) else shutil.which("keytool") or "keytool"
        pw = material["store_password"]
        steps = [
            [
                keytool,
                "-genkeypair",
                "-alias",
                "broker",
                "-keyalg",
                "RSA",
                "-keysize",
                "2048",
                "-validity",
                "365",
                "-dname",
                "CN=localhost",
                "-ext",
                "SAN=ip:127.0.0.1,dns:localhost",
                "-keystore",
                material["keystore"],
                "-storetype",
                "PKCS12",
                "-storepass",
                pw,
                "-keypass",
                pw,
                "-noprompt",
            ],
            [
                keytool,
                "-exportcert",
                "-rfc",
                "-alias",
                "broker",
                "-keystore",
                material["keystore"],
                "-storepass",
                pw,
                "-file",
                material["ca"],
            ],
            [
                keytool,
                "-importcert",
                "-noprompt",
                "-alias",
                "broker-ca",
                "-file",
                material["ca"],
                "-keystore",
                material["truststore"],
                "-storetype",
                "PKCS12",
                "-storepass",
                pw,
            ],
        ]
        for step in steps:
            done = subprocess.run(step, check=False, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise StackError(f"keytool failed: {done.stderr.strip() or done.stdout.strip()}")
        for f in ("keystore", "truststore", "ca"):
            Path(material[f]).chmod(0o600)
    return material


LOG4J1 = """\
# generated by deploy/stack.py (Kafka 3.x, reload4j): everything at INFO to stdout -> kafka.log
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
"""

LOG4J2 = """\
<?xml version="1.0" encoding="UTF-8"?>
<!-- generated by deploy/stack.py (Kafka 4.x, log4j2): everything at INFO to stdout -> kafka.log -->
<Configuration status="warn">
  <Appenders>
    <Console name="STDOUT" target="SYSTEM_OUT">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
    </Console>
  </Appenders>
  <Loggers>
    <Root level="info"><AppenderRef ref="STDOUT"/></Root>
  </Loggers>
</Configuration>
"""


# --secure: Redis ACL users (the default user is off). Commands a Lua script runs are checked
# against the caller's ACL, so an agent (a reader) cannot commit through the commit script.
REDIS_USERS = {
    "worker": "~* &* +@all",
    "operator": "~* &* +@all",  # `replay` rewrites projections
    "agent": "~* -@all +@read +@connection +evalsha +script|load +multi +exec",
}


def redis_acl(p: Paths) -> Path:
    """--secure: the ACL file of the stack's Redis (made once; passwords in secure/redis-*)."""
    p.secure.mkdir(parents=True, exist_ok=True)
    p.secure.chmod(0o700)
    lines = ["user default off"]
    for user, rules in REDIS_USERS.items():
        path = p.secure / f"redis-{user}.password"
        if not path.exists():
            path.write_text(secrets.token_hex(16) + "\n")
            path.chmod(0o600)
        lines.append(f"user {user} on >{path.read_text().strip()} {rules}")
    acl = p.secure / "redis.acl"
    acl.write_text("\n".join(lines) + "\n")
    acl.chmod(0o600)
    return acl


def start_redis(p: Paths, redis_bin: str, port: int, secure: bool = False) -> Status:
    for f in (p.redis_pid, p.redis_log):
        f.unlink(missing_ok=True)
    write_text_atomic(p.redis_json, json.dumps({"port": port, "secure": secure}) + "\n")
    cmd = [
        redis_bin,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "yes",
        "--pidfile",
        str(p.redis_pid),
        "--logfile",
        str(p.redis_log),
        "--dir",
        str(p.dir),
        *(("--aclfile", str(redis_acl(p))) if secure else ()),
    ]
    info(f"starting redis-server on 127.0.0.1:{port} ...")
    res = subprocess.run(
        cmd, check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30
    )
    if res.returncode != 0:
        raise StackError(
            f"redis-server exited with {res.returncode}",
            log=p.redis_log,
            output=res.stdout + res.stderr,
        )
    deadline = time.monotonic() + REDIS_READY_TIMEOUT
    while time.monotonic() < deadline:
        st = redis_status(p)
        if st.state == "up":
            return st
        time.sleep(0.1)
    pid = read_pid(p.redis_pid)
    if pid and pid_alive(pid):
        stop_pid(pid, REDIS_STOP_TIMEOUT)
    p.redis_pid.unlink(missing_ok=True)
    raise StackError(
        f"redis-server not answering on 127.0.0.1:{port} after {REDIS_READY_TIMEOUT:.0f}s",
        log=p.redis_log,
    )


# --------------------------------------------------------------------------- redis cluster


def redis_call(port: int, *args: str, timeout: float = 2.0) -> str | None:
    """One command to the redis-server on `port`: its reply as text (a bulk string, a status or
    an integer), or None if it answers with an error or not at all."""
    payload = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(payload.encode())
            with sock.makefile("rb") as reply:
                line = reply.readline()
                if line[:1] == b"$":
                    size = int(line[1:])
                    return None if size < 0 else reply.read(size + 2)[:-2].decode(errors="replace")
                if line[:1] in (b"+", b":"):
                    return line[1:].strip().decode(errors="replace")
                return None
    except (OSError, ValueError):
        return None


def redis_fields(text: str | None) -> dict[str, str]:
    """`name:value` lines of an INFO or CLUSTER INFO reply."""
    return dict(line.strip().split(":", 1) for line in (text or "").splitlines() if ":" in line)


def find_redis_cli(redis_bin: str) -> str:
    """redis-cli (Debian's redis-tools, which redis-server depends on), for --cluster create."""
    found = shutil.which("redis-cli") or str(Path(redis_bin).with_name("redis-cli"))
    if not os.access(found, os.X_OK):
        raise StackError(
            "redis-cli not found: install redis-tools (apt-get install -y redis-tools)", code=2
        )
    out = subprocess.run(
        [redis_bin, "--version"], check=False, capture_output=True, text=True, timeout=30
    ).stdout
    m = re.search(r"v=(\d+)\.", out)
    if m and int(m[1]) < 7:
        raise StackError(
            f"--redis-cluster needs redis-server >= 7.0 (--cluster-port); {out.strip()}", code=2
        )
    return found


def _redis_node_cmd(redis_bin: str, node: RedisNode, port: int, bus_port: int) -> list[str]:
    return [
        redis_bin,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        str(node.dir / "nodes.conf"),
        "--cluster-port",
        str(bus_port),
        "--cluster-node-timeout",
        str(REDIS_CLUSTER_NODE_TIMEOUT_MS),
        "--repl-diskless-sync-delay",  # a replica syncs at once (Redis waits 5 s by default)
        "0",
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "yes",
        "--pidfile",
        str(node.pid),
        "--logfile",
        str(node.log),
        "--dir",
        str(node.dir),
    ]


def _start_redis_nodes(redis_bin: str, nodes: list[tuple[RedisNode, int, int]]) -> None:
    """Start these cluster nodes (daemonized) and wait until each answers PING."""
    for node, port, bus_port in nodes:
        node.pid.unlink(missing_ok=True)
        node.dir.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(
            _redis_node_cmd(redis_bin, node, port, bus_port),
            check=False,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=30,
        )
        if res.returncode != 0:
            raise StackError(
                f"{node.label}: redis-server exited with {res.returncode}",
                log=node.log,
                output=res.stdout + res.stderr,
            )
    deadline = time.monotonic() + REDIS_READY_TIMEOUT
    for node, port, _ in nodes:
        while not redis_ping(port):
            if time.monotonic() > deadline:
                raise StackError(
                    f"{node.label} not answering on 127.0.0.1:{port} after "
                    f"{REDIS_READY_TIMEOUT:.0f}s",
                    log=node.log,
                )
            time.sleep(0.05)


def redis_cluster_problem(ports: list[int]) -> str:
    """What keeps the cluster on `ports` from being ready ('' when it is): every node sees
    cluster_state:ok and every node, and every replica's link to its master is up."""
    masters = 0
    for port in ports:
        cinfo = redis_fields(redis_call(port, "CLUSTER", "INFO"))
        if not cinfo:
            return f"127.0.0.1:{port} does not answer"
        if cinfo.get("cluster_state") != "ok":
            return f"127.0.0.1:{port} has cluster_state:{cinfo.get('cluster_state', '?')}"
        if cinfo.get("cluster_known_nodes") != str(len(ports)):
            return (
                f"127.0.0.1:{port} knows {cinfo.get('cluster_known_nodes')} of {len(ports)} nodes"
            )
        repl = redis_fields(redis_call(port, "INFO", "replication"))
        if repl.get("role") == "master":
            masters += 1
        elif repl.get("master_link_status") != "up":
            return f"the replica 127.0.0.1:{port} is not linked to its master yet"
    want = len(ports) // (REDIS_CLUSTER_REPLICAS + 1)
    return "" if masters == want else f"{masters} masters, not {want}"


def wait_redis_cluster(ports: list[int], timeout: float = REDIS_CLUSTER_READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while problem := redis_cluster_problem(ports):
        if time.monotonic() > deadline:
            raise StackError(f"the redis cluster is not ready after {timeout:.0f}s: {problem}")
        time.sleep(0.1)


def _stop_redis_nodes(nodes: list[RedisNode]) -> None:
    pids = [pid for pid in (read_pid(n.pid) for n in nodes) if pid and pid_alive(pid)]
    stop_pids(pids, REDIS_STOP_TIMEOUT)
    for n in nodes:
        n.pid.unlink(missing_ok=True)


def start_redis_cluster(
    p: Paths, redis_bin: str, redis_cli: str, ports: list[tuple[int, int]]
) -> None:
    """Fresh cluster nodes on `ports` (port, cluster bus port), joined by `redis-cli --cluster
    create` into masters and replicas; returns once the cluster is ready."""
    nodes = [p.redis_node(i) for i in range(1, len(ports) + 1)]
    for node in nodes:
        shutil.rmtree(node.dir, ignore_errors=True)
        node.log.unlink(missing_ok=True)
    write_text_atomic(
        p.redis_cluster_json,
        json.dumps(
            {
                "nodes": [
                    {"index": n.index, "port": port, "bus_port": bus}
                    for n, (port, bus) in zip(nodes, ports, strict=True)
                ],
                "replicas": REDIS_CLUSTER_REPLICAS,
                "node_timeout_ms": REDIS_CLUSTER_NODE_TIMEOUT_MS,
            },
            indent=2,
        )
        + "\n",
    )
    shown = ",".join(str(port) for port, _ in ports)
    info(f"starting a redis cluster on 127.0.0.1:{shown} ...")
    t0 = time.monotonic()
    try:
        _start_redis_nodes(
            redis_bin, [(n, port, bus) for n, (port, bus) in zip(nodes, ports, strict=True)]
        )
        create = [
            redis_cli,
            "--cluster",
            "create",
            *(f"127.0.0.1:{port}" for port, _ in ports),
            "--cluster-replicas",
            str(REDIS_CLUSTER_REPLICAS),
            "--cluster-yes",
        ]
        with open(p.redis_cluster_log, "w") as log:
            log.write("$ " + " ".join(create) + "\n")
            log.flush()
            try:
                rc: int | str = subprocess.run(
                    create,
                    check=False,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=REDIS_CLUSTER_READY_TIMEOUT,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc != 0:
            raise StackError(f"redis-cli --cluster create failed ({rc})", log=p.redis_cluster_log)
        wait_redis_cluster([port for port, _ in ports])
    except BaseException:
        _stop_redis_nodes(nodes)
        raise
    info(f"redis cluster ready in {time.monotonic() - t0:.1f}s")


def redis_masters(p: Paths) -> list[tuple[RedisNode, int]]:
    """The cluster's masters now (node, port), in node order, as a live node sees them."""
    layout = redis_cluster_layout(p)
    by_port = {int(entry["port"]): node for node, entry, _ in layout}
    for _, entry, st in layout:
        if st.state != "up":
            continue
        text = redis_call(int(entry["port"]), "CLUSTER", "NODES")
        if text is None:
            continue
        masters = []
        for line in text.splitlines():
            fields = line.split()
            if len(fields) < 3 or "master" not in fields[2].split(",") or "fail" in fields[2]:
                continue
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            if port in by_port:
                masters.append((by_port[port], port))
        return sorted(masters, key=lambda m: m[0].index)
    raise StackError(f"no redis cluster node answers in {p.dir}")


def kill_redis_master(p: Paths, index: int | None = None) -> tuple[int, int]:
    """Crash a master of the cluster with SIGKILL (node `index`, or the first master): returns
    (its index, its port). Its replica takes over after the cluster's node timeout."""
    masters = redis_masters(p)
    chosen = [m for m in masters if index is None or m[0].index == index]
    if not chosen:
        raise StackError(
            f"redis-cluster-{index} is not a master (masters: {[m[0].index for m in masters]})",
            code=2,
        )
    node, port = chosen[0]
    pid = read_pid(node.pid)
    if pid is None or not pid_alive(pid):
        raise StackError(f"{node.label} is not running")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    node.pid.unlink(missing_ok=True)
    return node.index, port


def start_redis_node(p: Paths, index: int) -> Status:
    """Start cluster node `index` again with its nodes.conf (it rejoins, as a replica if it was
    failed over); a node already up is left alone."""
    for node, entry, st in redis_cluster_layout(p):
        if node.index != index:
            continue
        if st.state == "up":
            return st
        if st.pid:
            stop_pid(st.pid, REDIS_STOP_TIMEOUT)
        port = int(entry["port"])
        _start_redis_nodes(find_redis(p), [(node, port, int(entry["bus_port"]))])
        return _redis_status(node.pid, port, p.redis_cluster_json.name)
    raise StackError(f"no redis-cluster-{index} in {p.dir}", code=2)


def kafka_ready_timeout() -> float:
    try:
        return float(os.environ.get("MILPA_KAFKA_READY_TIMEOUT") or 90)
    except ValueError:
        raise StackError("MILPA_KAFKA_READY_TIMEOUT must be a number of seconds", code=2) from None


def _prepare_node(node: KafkaNode, props: str) -> None:
    """Fresh log.dirs and a new server.properties for `node` (before its storage is formatted)."""
    node.pid.unlink(missing_ok=True)
    shutil.rmtree(node.data, ignore_errors=True)  # fresh log.dirs for every start
    node.data.mkdir(parents=True)
    write_text_atomic(node.props, props)
    node.props.chmod(0o600)  # with --secure it holds the admin's and the keystores' passwords


def _kafka_jvm(java: str, lib: Path, node: KafkaNode, version: str) -> list[str]:
    """The JVM command line up to the main class (its log configuration written beside it)."""
    if kafka_major(version) >= 4:
        log_cfg = node.dir / "log4j2.xml"
        log_cfg.write_text(LOG4J2)
        log_flag = f"-Dlog4j2.configurationFile={log_cfg}"
    else:
        log_cfg = node.dir / "log4j.properties"
        log_cfg.write_text(LOG4J1)
        log_flag = f"-Dlog4j.configuration=file:{log_cfg}"
    return [
        java,
        *KAFKA_JVM_HEAP,
        "-XX:+UseG1GC",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        log_flag,
        "-cp",
        f"{lib}/*",
    ]


def _format_storage(
    jobs: list[tuple[KafkaNode, list[str]]], cluster_id: str, material: dict[str, str] | None
) -> None:
    """Format every node's log.dirs with `cluster_id`, the nodes in parallel (output to their
    logs, which this starts afresh)."""
    running: list[tuple[KafkaNode, subprocess.Popen[bytes]]] = []
    try:
        for node, jvm in jobs:
            fmt = [
                *jvm,
                "kafka.tools.StorageTool",
                "format",
                "-t",
                cluster_id,
                "-c",
                str(node.props),
            ]
            for user, password in ((u, material[u]) for u in SCRAM_USERS) if material else ():
                fmt += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]
            shown = [
                a.split("password=")[0] + "password=***]" if "password=" in a else a for a in fmt
            ]
            with open(node.log, "w") as log:
                log.write("$ " + " ".join(shown) + "\n")
                log.flush()
                proc = subprocess.Popen(
                    fmt, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
            running.append((node, proc))
        deadline = time.monotonic() + 120
        for node, proc in running:
            rc: int | str
            try:
                rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                raise StackError(f"kafka storage format failed ({rc})", log=node.log)
    finally:
        for _, proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _launch(node: KafkaNode, jvm: list[str]) -> subprocess.Popen[bytes]:
    """Start the broker of `node` (its output appended to its log) and write its pid file."""
    with open(node.log, "a") as log:
        log.write("$ " + " ".join([*jvm, "kafka.Kafka", str(node.props)]) + "\n")
        log.flush()
        proc = subprocess.Popen(
            [*jvm, "kafka.Kafka", str(node.props)],
            cwd=node.dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    write_text_atomic(node.pid, f"{proc.pid}\n")
    return proc


@dataclass
class _Starting:
    node: KafkaNode
    proc: subprocess.Popen[bytes]
    port: int
    offset: int  # where its log was when it started: the ready marker must come after
    seen: str = ""  # the end of what was read, for a marker split across two reads
    marked: bool = False  # the ready marker was logged
    ready: bool = False


def _wait_ready(starting: list[_Starting], t0: float, timeout: float) -> list[Status]:
    """Wait until every broker logged that it started and accepts connections; on failure (or
    Ctrl-C) stop all of them."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            for s in (s for s in starting if not s.ready):
                exit_code = s.proc.poll()
                if exit_code is not None:
                    raise StackError(
                        f"{s.node.label} exited with code {exit_code} during start-up",
                        log=s.node.log,
                    )
                with open(s.node.log, errors="replace") as fh:
                    fh.seek(s.offset)
                    chunk = fh.read()
                    s.offset = fh.tell()
                # The whole chunk is searched: a broker logs hundreds of lines right after the
                # marker, which a slow poll reads in one chunk with the marker far from its end.
                window = s.seen + chunk
                s.marked = s.marked or KAFKA_READY_MARKER in window
                s.seen = window[-len(KAFKA_READY_MARKER) :]
                if s.marked and port_open(s.port):
                    s.ready = True
                    info(f"{s.node.label} ready in {time.monotonic() - t0:.1f}s")
            if all(s.ready for s in starting):
                return [Status("up", s.proc.pid, s.port) for s in starting]
            if time.monotonic() > deadline:
                late = next(s for s in starting if not s.ready)
                raise StackError(
                    f"{late.node.label} not ready after {timeout:.0f}s", log=late.node.log
                )
            time.sleep(0.25)
    except BaseException:
        for s in starting:
            if s.proc.poll() is None:
                stop_pid(s.proc.pid, 10, s.proc)
            s.node.pid.unlink(missing_ok=True)
        raise


def start_kafka(
    p: Paths, *, java: str, lib: Path, version: str, port: int, cport: int, secure: bool = False
) -> Status:
    timeout = kafka_ready_timeout()
    node = p.kafka_single()
    material = secure_material(p, java) if secure else None
    _prepare_node(node, kafka_properties(port, cport, node.data, version, material))
    jvm = _kafka_jvm(java, lib, node, version)
    cluster_id = new_cluster_id()
    write_text_atomic(
        p.kafka_json,
        json.dumps(
            {
                "version": version,
                "port": port,
                "controller_port": cport,
                "cluster_id": cluster_id,
                "log_dirs": str(node.data),
                "secure": secure,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            indent=2,
        )
        + "\n",
    )

    info(f"starting Kafka {version} on 127.0.0.1:{port} (controller {cport}) ...")
    t0 = time.monotonic()
    _format_storage([(node, jvm)], cluster_id, material)
    proc = _launch(node, jvm)
    return _wait_ready([_Starting(node, proc, port, 0)], t0, timeout)[0]


def start_kafka_cluster(
    p: Paths,
    *,
    java: str,
    lib: Path,
    version: str,
    ports: list[tuple[int, int]],
    meanwhile: Callable[[], object] | None = None,
) -> list[Status]:
    """A cluster of len(ports) combined nodes, formatted and started in parallel; `meanwhile`
    runs while they boot (e.g. starting the redis cluster)."""
    timeout = kafka_ready_timeout()
    nodes = [p.kafka_node(i) for i in range(1, len(ports) + 1)]
    props = cluster_properties(ports, [n.data for n in nodes], version)
    for node, text in zip(nodes, props, strict=True):
        _prepare_node(node, text)
    jvms = [_kafka_jvm(java, lib, node, version) for node in nodes]
    cluster_id = new_cluster_id()
    replicas = min(len(ports), 3)
    write_text_atomic(
        p.kafka_json,
        json.dumps(
            {
                "version": version,
                "brokers": len(nodes),
                "replication_factor": replicas,
                "min_insync_replicas": min(replicas, CLUSTER_MIN_INSYNC),
                "cluster_id": cluster_id,
                "nodes": [
                    {
                        "node_id": node.node_id,
                        "port": port,
                        "controller_port": cport,
                        "log_dirs": str(node.data),
                    }
                    for node, (port, cport) in zip(nodes, ports, strict=True)
                ],
                "secure": False,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            indent=2,
        )
        + "\n",
    )
    shown = ",".join(str(port) for port, _ in ports)
    controllers = ",".join(str(cport) for _, cport in ports)
    info(
        f"starting a {len(nodes)}-broker Kafka {version} cluster on 127.0.0.1:{shown} "
        f"(controllers {controllers}) ..."
    )
    t0 = time.monotonic()
    _format_storage(list(zip(nodes, jvms, strict=True)), cluster_id, None)
    starting: list[_Starting] = []
    try:
        for node, jvm, (port, _) in zip(nodes, jvms, ports, strict=True):
            offset = node.log.stat().st_size
            starting.append(_Starting(node, _launch(node, jvm), port, offset))
    except BaseException:
        for s in starting:
            stop_pid(s.proc.pid, 10, s.proc)
        raise
    try:
        if meanwhile is not None:
            meanwhile()
    except BaseException:
        for s in starting:
            stop_pid(s.proc.pid, 10, s.proc)
            s.node.pid.unlink(missing_ok=True)
        raise
    statuses = _wait_ready(starting, t0, timeout)
    info(f"kafka cluster ready in {time.monotonic() - t0:.1f}s")
    return statuses


def _cluster_node(p: Paths, n: int) -> tuple[KafkaNode, dict[str, Any], dict[str, Any]]:
    meta = read_json(p.kafka_json)
    for entry in cluster_nodes(meta):
        if int(entry["node_id"]) == n:
            return p.kafka_node(n), entry, meta
    ids = [int(e["node_id"]) for e in cluster_nodes(meta)]
    if not ids:
        raise StackError(f"no Kafka cluster in {p.dir} (start one with `up --brokers 3`)", code=2)
    raise StackError(f"no broker {n} in the cluster of {p.dir} (brokers: {ids})", code=2)


def kill_broker(p: Paths, n: int) -> int:
    """Crash broker `n` of the cluster: SIGKILL, no shutdown; its data stays. Returns its pid."""
    node, entry, _ = _cluster_node(p, n)
    st = node_status(node, entry.get("port"))
    if st.pid is None:
        raise StackError(f"{node.label} is not running ({st.detail})")
    with contextlib.suppress(ProcessLookupError):
        os.kill(st.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(st.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(st.pid):
        raise StackError(f"{node.label} (pid {st.pid}) still alive 10 s after SIGKILL")
    node.pid.unlink(missing_ok=True)
    return st.pid


def restart_brokers(p: Paths, ids: list[int]) -> list[Status]:
    """Start brokers `ids` of the cluster again on their data (after `kill_broker`), all at once
    (a quorum may need more than one of them), and wait until they are ready. Brokers already up
    are left alone."""
    starting: list[_Starting] = []
    statuses: dict[int, Status] = {}
    t0 = time.monotonic()
    try:
        for n in ids:
            node, entry, meta = _cluster_node(p, n)
            port = int(entry["port"])
            st = node_status(node, port)
            if st.state == "up":
                info(f"{node.label} is already up (pid {st.pid})")
                statuses[n] = st
                continue
            if st.state == "unhealthy" and st.pid:
                info(f"{node.label}: {st.detail}; restarting it")
                stop_pid(st.pid, KAFKA_STOP_TIMEOUT)
            if not (node.data / "meta.properties").exists():
                raise StackError(f"{node.label} has no formatted data in {node.data}", code=2)
            version = str(meta["version"])
            lib = lib_dir(version)
            if not libs_ready(lib, version):
                raise StackError(f"the Kafka {version} jars are not in {lib}; run `up`", code=2)
            jvm = _kafka_jvm(find_java(version), lib, node, version)
            info(f"starting {node.label} again on 127.0.0.1:{port} ...")
            offset = node.log.stat().st_size if node.log.exists() else 0
            starting.append(_Starting(node, _launch(node, jvm), port, offset))
    except BaseException:
        for s in starting:
            stop_pid(s.proc.pid, 10, s.proc)
            s.node.pid.unlink(missing_ok=True)
        raise
    ready = _wait_ready(starting, t0, kafka_ready_timeout()) if starting else []
    statuses.update({s.node.node_id: st for s, st in zip(starting, ready, strict=True)})
    return [statuses[n] for n in ids]


def start_broker(p: Paths, n: int) -> Status:
    """Start broker `n` of the cluster again on its data; waits until it is ready."""
    return restart_brokers(p, [n])[0]


# --------------------------------------------------------------------------- commands


def cmd_up(
    p: Paths, export: bool, secure: bool = False, brokers: int = 1, redis_cluster: bool = False
) -> int:
    if brokers not in CLUSTER_SIZES:
        raise StackError(f"--brokers {brokers}: expected one of {list(CLUSTER_SIZES)}", code=2)
    if secure and (brokers > 1 or redis_cluster):
        raise StackError(
            "--secure runs one broker and one redis-server: it does not combine with "
            "--brokers 3 or --redis-cluster",
            code=2,
        )
    version = kafka_version()
    want_kport = env_int("MILPA_KAFKA_PORT")
    want_cport = env_int("MILPA_KAFKA_CONTROLLER_PORT")
    want_rport = env_int("MILPA_REDIS_PORT")
    with state_lock(p.dir):
        layout = kafka_layout(p)
        if any(st.state != "down" for _, st in layout) and len(layout) != brokers:
            have = "one broker" if len(layout) == 1 else f"{len(layout)} brokers"
            again = "up" if len(layout) == 1 else f"up --brokers {len(layout)}"
            raise StackError(
                f"Kafka runs with {have} in {p.dir}: run `down` first, or `{again}`", code=2
            )
        if brokers == 1:
            nodes, kstates = [p.kafka_single()], [kafka_status(p)]
        else:
            nodes = [p.kafka_node(i) for i in range(1, brokers + 1)]
            kstates = (
                [st for _, st in layout] if len(layout) == brokers else [Status("down")] * brokers
            )
        kafka_up = all(st.state == "up" for st in kstates)
        rs = redis_status(p)
        rc_layout = redis_cluster_layout(p)
        rc_up = bool(rc_layout) and all(st.state == "up" for _, _, st in rc_layout)
        need_rc = redis_cluster and not rc_up
        if rc_up and not redis_cluster:
            info("note: the redis cluster of this state dir is running and stays so")
        if kafka_up and rs.state == "up" and not need_rc:
            running = read_json(p.kafka_json).get("version")
            if running and running != version:
                info(
                    f"note: Kafka {running} is running (wanted {version}); "
                    "run `down` then `up` to switch"
                )
            for name, wanted, st in (
                ("MILPA_KAFKA_PORT", want_kport if brokers == 1 else None, kstates[0]),
                ("MILPA_REDIS_PORT", want_rport, rs),
            ):
                if wanted and wanted != st.port:
                    info(
                        f"note: already running on port {st.port}; "
                        f"{name}={wanted} ignored (run `down` first)"
                    )
            write_text_atomic(p.env, "\n".join(env_lines(p, rc_up)) + "\n")
            print_env(env_lines(p, rc_up), export)
            return 0

        # Pre-flight: fail fast (exit 2) on missing tools before starting anything.
        java = find_java(version) if not kafka_up else None
        redis_bin = find_redis(p) if rs.state != "up" or need_rc else None
        redis_cli = find_redis_cli(redis_bin) if need_rc and redis_bin else None
        if not kafka_up and not libs_ready(lib_dir(version), version) and not shutil.which("mvn"):
            raise StackError(
                "mvn not found: install Maven (apt-get install -y maven) to resolve the Kafka jars",
                code=2,
            )
        if brokers > 1 and (want_kport or want_cport):
            info("note: MILPA_KAFKA_PORT/MILPA_KAFKA_CONTROLLER_PORT apply to one broker; ignored")

        # Stop half-alive leftovers (process alive but not answering).
        for st, pidfile, label, t in (
            *(
                (st, n.pid, n.label, KAFKA_STOP_TIMEOUT)
                for n, st in zip(nodes, kstates, strict=True)
            ),
            (rs, p.redis_pid, "redis", REDIS_STOP_TIMEOUT),
            *((st, n.pid, n.label, REDIS_STOP_TIMEOUT) for n, _, st in rc_layout if need_rc),
        ):
            if st.state == "unhealthy" and st.pid:
                info(f"{label}: {st.detail}; restarting it")
                stop_pid(st.pid, t)
            if st.state != "up":
                pidfile.unlink(missing_ok=True)
        # Part of a cluster still up: the others start again on their data (a fresh node could
        # not join the quorum it left); nothing up: a fresh cluster.
        dead = [n for n, st in zip(nodes, kstates, strict=True) if st.state != "up"]
        partial = brokers > 1 and 0 < len(dead) < brokers
        if partial and not all((n.data / "meta.properties").exists() for n in dead):
            info("kafka: a stopped broker lost its data; starting a fresh cluster")
            stop_pids([st.pid for st in kstates if st.pid], KAFKA_STOP_TIMEOUT)
            partial = False
        rc_dead = [n.index for n, _, st in rc_layout if st.state != "up"]
        rc_partial = need_rc and 0 < len(rc_dead) < len(rc_layout)

        requests: list[tuple[str, int | None]] = []
        if rs.state != "up":
            requests.append(("MILPA_REDIS_PORT", want_rport))
        if not kafka_up and brokers == 1:
            requests += [
                ("MILPA_KAFKA_PORT", want_kport),
                ("MILPA_KAFKA_CONTROLLER_PORT", want_cport),
            ]
        elif not kafka_up and not partial:
            requests += [
                (f"{n.label} {what}", None) for n in nodes for what in ("port", "controller")
            ]
        if need_rc and not rc_partial:
            requests += [
                (f"redis-cluster-{i} {what}", None)
                for i in range(1, REDIS_CLUSTER_NODES + 1)
                for what in ("port", "bus")
            ]
        ports = pick_ports(requests)
        rport = ports.pop(0) if rs.state != "up" else 0
        lib = ensure_kafka_libs(p, version) if java else None

        p.env.unlink(missing_ok=True)
        if rs.state != "up" and redis_bin:
            start_redis(p, redis_bin, rport, secure)
        rc_start: Callable[[], None] | None = None
        if need_rc and redis_bin and redis_cli and not rc_partial:
            pairs = [(ports[-2 * i], ports[-2 * i + 1]) for i in range(REDIS_CLUSTER_NODES, 0, -1)]
            del ports[-2 * REDIS_CLUSTER_NODES :]
            rc_start = functools.partial(start_redis_cluster, p, redis_bin, redis_cli, pairs)
        if rc_partial:
            for index in rc_dead:
                start_redis_node(p, index)
            wait_redis_cluster([int(e["port"]) for _, e, _ in rc_layout])
        if rc_start is not None and (kafka_up or brokers == 1 or partial):
            rc_start()  # else while the brokers boot
            rc_start = None
        if java and lib:
            try:
                if brokers == 1:
                    kport, cport = ports
                    start_kafka(
                        p,
                        java=java,
                        lib=lib,
                        version=version,
                        port=kport,
                        cport=cport,
                        secure=secure,
                    )
                elif partial:
                    restart_brokers(p, [n.node_id for n in dead])
                else:
                    kpairs = [(ports[2 * i], ports[2 * i + 1]) for i in range(brokers)]
                    start_kafka_cluster(
                        p, java=java, lib=lib, version=version, ports=kpairs, meanwhile=rc_start
                    )
            except StackError as exc:
                exc.args = (f"{exc.args[0]} (redis is still running; `stack.py down` stops it)",)
                raise
        with_cluster = redis_cluster or rc_up
        write_text_atomic(p.env, "\n".join(env_lines(p, with_cluster)) + "\n")
        print_env(env_lines(p, with_cluster), export)
        return 0


def _stop(items: list[tuple[str, Status, Path]], timeout: float) -> None:
    """Stop these services at once (SIGTERM, SIGKILL after `timeout`), one line each."""
    t0 = time.monotonic()
    killed = stop_pids([st.pid for _, st, _ in items if st.pid], timeout)
    took = time.monotonic() - t0
    for label, st, pidfile in items:
        if st.pid:
            how = "SIGKILL after timeout" if st.pid in killed else "SIGTERM"
            print(f"{label}: stopped pid {st.pid} ({how}, {took:.1f}s)")
        else:
            print(f"{label}: not running")
        pidfile.unlink(missing_ok=True)


def cmd_down(p: Paths) -> int:
    with state_lock(p.dir):
        _stop([(n.label, st, n.pid) for n, st in kafka_layout(p)], KAFKA_STOP_TIMEOUT)
        _stop([("redis", redis_status(p), p.redis_pid)], REDIS_STOP_TIMEOUT)
        rc_layout = redis_cluster_layout(p)
        if rc_layout:
            _stop([(n.label, st, n.pid) for n, _, st in rc_layout], REDIS_STOP_TIMEOUT)
            p.redis_cluster_json.unlink(missing_ok=True)
        p.env.unlink(missing_ok=True)
    return 0


def cmd_status(p: Paths) -> int:
    kmeta = read_json(p.kafka_json)
    entries = {int(e["node_id"]): e for e in cluster_nodes(kmeta)}
    ok = True
    for node, st in kafka_layout(p):
        ok = ok and st.state == "up"
        if st.state != "up":
            print(f"{node.label}: {st.state:<5} {st.detail}")
            continue
        cport = (
            entries[node.node_id]["controller_port"] if entries else kmeta.get("controller_port")
        )
        print(
            f"{node.label}: up    pid={st.pid} bootstrap=127.0.0.1:{st.port} controller=127.0.0.1:"
            f"{cport} version={kmeta.get('version')} log={node.log}"
        )
    rs = redis_status(p)
    if rs.state == "up":
        print(f"redis: up    pid={rs.pid} url=redis://127.0.0.1:{rs.port}/0 log={p.redis_log}")
    else:
        print(f"redis: {rs.state:<5} {rs.detail}")
    ok = ok and rs.state == "up"
    rc_layout = redis_cluster_layout(p)
    for rnode, _, st in rc_layout:
        ok = ok and st.state == "up"
        if st.state != "up":
            print(f"{rnode.label}: {st.state:<5} {st.detail}")
            continue
        role = redis_fields(redis_call(int(st.port or 0), "INFO", "replication")).get("role", "?")
        print(
            f"{rnode.label}: up    pid={st.pid} url=redis://127.0.0.1:{st.port} role={role} "
            f"log={rnode.log}"
        )
    if rc_layout:
        problem = redis_cluster_problem([int(e["port"]) for _, e, _ in rc_layout])
        print(f"redis-cluster: {'ok' if not problem else 'not ready: ' + problem}")
        ok = ok and not problem
    return 0 if ok else 1


def cmd_env(p: Paths, export: bool) -> int:
    try:
        lines = [line for line in p.env.read_text().splitlines() if line.strip()]
    except OSError:
        raise StackError(
            f"stack is not up (no {p.env}); run: python3 {Path(sys.argv[0])} up"
        ) from None
    print_env(lines, export)
    return 0


def cmd_node(p: Paths, command: str, node: int | None) -> int:
    """kill-broker N, start-broker N, kill-redis-master [I], start-redis-node I."""
    if node is None and command != "kill-redis-master":
        raise StackError(f"{command} needs the node: {command} N", code=2)
    with state_lock(p.dir):
        if command == "kill-broker" and node is not None:
            print(f"kafka-{node}: killed pid {kill_broker(p, node)} (SIGKILL)")
        elif command == "start-broker" and node is not None:
            st = start_broker(p, node)
            print(f"kafka-{node}: up    pid={st.pid} bootstrap=127.0.0.1:{st.port}")
        elif command == "kill-redis-master":
            index, port = kill_redis_master(p, node)
            print(f"redis-cluster-{index}: killed the master on 127.0.0.1:{port} (SIGKILL)")
        elif node is not None:
            st = start_redis_node(p, node)
            wait_redis_cluster([int(e["port"]) for _, e, _ in redis_cluster_layout(p)])
            print(f"redis-cluster-{node}: {st.state} pid={st.pid} url=redis://127.0.0.1:{st.port}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="stack.py",
        description="Local Kafka (KRaft, from Maven jars) + redis-server for milpa-sessions.",
    )
    ap.add_argument(
        "command",
        choices=[
            "up",
            "down",
            "status",
            "env",
            "kill-broker",
            "start-broker",
            "kill-redis-master",
            "start-redis-node",
        ],
    )
    ap.add_argument(
        "node",
        nargs="?",
        type=int,
        help="kill-broker, start-broker: the broker's node id (1..3); start-redis-node: the "
        "node's index (1..6); kill-redis-master: which master (default: the first)",
    )
    ap.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("MILPA_STACK_DIR") or DEFAULT_STATE_DIR),
        help="state directory (default: $MILPA_STACK_DIR or deploy/.run)",
    )
    ap.add_argument("--export", action="store_true", help="print `export VAR=...` lines (up, env)")
    ap.add_argument(
        "--secure",
        action="store_true",
        help="up: the broker on SASL_SSL (SCRAM users admin, agent, worker, operator; ACLs on) "
        "and Redis with ACL users (worker, operator, agent: read only)",
    )
    ap.add_argument(
        "--brokers",
        type=int,
        default=1,
        choices=CLUSTER_SIZES,
        help="up: 3 starts a KRaft cluster of three broker+controller nodes (replication factor "
        "3, min.insync.replicas 2); default 1",
    )
    ap.add_argument(
        "--redis-cluster",
        action="store_true",
        help="up: also a Redis Cluster of 3 masters + 3 replicas (MILPA_REDIS_CLUSTER_URLS), "
        "beside the single redis-server of MILPA_REDIS_URL",
    )
    args = ap.parse_args(argv)
    p = Paths(args.state_dir.expanduser().resolve())
    try:
        if args.command == "up":
            p.dir.mkdir(parents=True, exist_ok=True)
        if args.command == "up":
            return cmd_up(p, args.export, args.secure, args.brokers, args.redis_cluster)
        if args.command in ("kill-broker", "start-broker", "kill-redis-master", "start-redis-node"):
            return cmd_node(p, args.command, args.node)
        if args.command == "down":
            if not p.dir.exists():
                print("kafka: not running\nredis: not running")
                return 0
            return cmd_down(p)
        if args.command == "status":
            return cmd_status(p)
        return cmd_env(p, args.export)
    except StackError as exc:
        print(f"stack: error: {exc}", file=sys.stderr)
        if exc.output.strip():
            print(exc.output.rstrip(), file=sys.stderr)
        if exc.log is not None:
            print(f"--- last {TAIL_LINES} lines of {exc.log} ---", file=sys.stderr)
            print(tail(exc.log), file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("stack: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
