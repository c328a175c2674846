#!/usr/bin/env python3
"""Local stack manager for milpa-sessions: a real Kafka broker + a real redis-server.

    python3 deploy/stack.py up|down|status|env [--state-dir DIR] [--export]

* Kafka: single node, KRaft, combined broker+controller, run with the machine's Java from jars
  that Maven resolves from Maven Central (deploy/kafka/pom.xml) into a per-version cache.
* Redis: Debian's redis-server (installed with apt-get when missing and running as root).
* Both listen on 127.0.0.1 on free ports (or MILPA_KAFKA_PORT / MILPA_REDIS_PORT).
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
from collections.abc import Iterator
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


class Paths:
    def __init__(self, state_dir: Path):
        self.dir = state_dir
        self.env = state_dir / "stack.env"
        self.kafka_pid = state_dir / "kafka.pid"
        self.kafka_json = state_dir / "kafka.json"
        self.kafka_log = state_dir / "kafka.log"
        self.kafka_dir = state_dir / "kafka"
        self.kafka_props = self.kafka_dir / "server.properties"
        self.kafka_data = self.kafka_dir / "data"
        self.redis_pid = state_dir / "redis.pid"
        self.redis_json = state_dir / "redis.json"
        self.redis_log = state_dir / "redis.log"
        self.maven_log = state_dir / "maven.log"
        self.secure = state_dir / "secure"  # --secure: keystores, the CA, one password per user
        self.apt_log = state_dir / "apt.log"


def kafka_status(p: Paths) -> Status:
    pid = read_pid(p.kafka_pid)
    meta = read_json(p.kafka_json)
    port = meta.get("port")
    if pid is None or not pid_alive(pid):
        return Status("down", detail="not running")
    cmd = pid_cmdline(pid)
    if cmd is not None and ("kafka.Kafka" not in cmd or str(p.kafka_props) not in cmd):
        return Status("down", detail=f"pid {pid} is not our broker (stale pid file)")
    if not port:
        return Status("unhealthy", pid, None, f"pid {pid} alive but {p.kafka_json.name} is missing")
    try:
        started = KAFKA_READY_MARKER in p.kafka_log.read_text(errors="replace")
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


def redis_status(p: Paths) -> Status:
    pid = read_pid(p.redis_pid)
    port = read_json(p.redis_json).get("port")
    if pid is None or not pid_alive(pid):
        return Status("down", detail="not running")
    cmd = pid_cmdline(pid)
    if cmd is not None and ("redis-server" not in cmd or (port and f":{port}" not in cmd)):
        return Status("down", detail=f"pid {pid} is not our redis-server (stale pid file)")
    if not port:
        return Status("unhealthy", pid, None, f"pid {pid} alive but {p.redis_json.name} is missing")
    if not redis_ping(port):
        return Status(
            "unhealthy", pid, port, f"pid {pid} alive but 127.0.0.1:{port} does not answer PING"
        )
    return Status("up", pid, port)


def env_lines(p: Paths) -> list[str]:
    kafka = read_json(p.kafka_json)
    redis = read_json(p.redis_json)
    rport = redis["port"]
    lines = [
        f"MILPA_KAFKA_BOOTSTRAP=127.0.0.1:{kafka['port']}",
        f"MILPA_REDIS_URL=redis://127.0.0.1:{rport}/0",
    ]
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
            "java not found: install a JDK >= 17 (e.g. apt-get install -y openjdk-17-jre-headless)",
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
    port: int, cport: int, data: Path, version: str, secure: dict[str, str] | None = None
) -> str:
    client = "SASL_SSL" if secure else "PLAINTEXT"
    props = [
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.voters=1@127.0.0.1:{cport}",
        f"listeners={client}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
        f"advertised.listeners={client}://127.0.0.1:{port}",
        "controller.listener.names=CONTROLLER",
        f"inter.broker.listener.name={client}",
        f"listener.security.protocol.map=CONTROLLER:PLAINTEXT,{client}:{client}",
        "offsets.topic.replication.factor=1",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "group.initial.rebalance.delay.ms=0",
        "num.partitions=6",
        "auto.create.topics.enable=false",
        f"log.dirs={data}",
    ]
    if kafka_major(version) >= 4:
        props += [
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
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


def start_kafka(
    p: Paths, *, java: str, lib: Path, version: str, port: int, cport: int, secure: bool = False
) -> Status:
    try:
        timeout = float(os.environ.get("MILPA_KAFKA_READY_TIMEOUT") or 90)
    except ValueError:
        raise StackError("MILPA_KAFKA_READY_TIMEOUT must be a number of seconds", code=2) from None
    p.kafka_pid.unlink(missing_ok=True)
    shutil.rmtree(p.kafka_data, ignore_errors=True)  # fresh log.dirs for every start
    p.kafka_data.mkdir(parents=True)
    material = secure_material(p, java) if secure else None
    write_text_atomic(p.kafka_props, kafka_properties(port, cport, p.kafka_data, version, material))
    p.kafka_props.chmod(0o600)  # with --secure it holds the admin's and the keystores' passwords
    if kafka_major(version) >= 4:
        log_cfg = p.kafka_dir / "log4j2.xml"
        log_cfg.write_text(LOG4J2)
        log_flag = f"-Dlog4j2.configurationFile={log_cfg}"
    else:
        log_cfg = p.kafka_dir / "log4j.properties"
        log_cfg.write_text(LOG4J1)
        log_flag = f"-Dlog4j.configuration=file:{log_cfg}"
    cluster_id = new_cluster_id()
    jvm = [
        java,
        *KAFKA_JVM_HEAP,
        "-XX:+UseG1GC",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        log_flag,
        "-cp",
        f"{lib}/*",
    ]
    write_text_atomic(
        p.kafka_json,
        json.dumps(
            {
                "version": version,
                "port": port,
                "controller_port": cport,
                "cluster_id": cluster_id,
                "log_dirs": str(p.kafka_data),
                "secure": secure,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            indent=2,
        )
        + "\n",
    )

    info(f"starting Kafka {version} on 127.0.0.1:{port} (controller {cport}) ...")
    t0 = time.monotonic()
    with open(p.kafka_log, "w") as log:
        fmt = [
            *jvm,
            "kafka.tools.StorageTool",
            "format",
            "-t",
            cluster_id,
            "-c",
            str(p.kafka_props),
        ]
        for user, password in ((u, material[u]) for u in SCRAM_USERS) if material else ():
            fmt += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]
        shown = [a.split("password=")[0] + "password=***]" if "password=" in a else a for a in fmt]
        log.write("$ " + " ".join(shown) + "\n")
        log.flush()
        rc: int | str
        try:
            rc = subprocess.run(
                fmt,
                check=False,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=120,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            raise StackError(f"kafka storage format failed ({rc})", log=p.kafka_log)
        log.write("$ " + " ".join([*jvm, "kafka.Kafka", str(p.kafka_props)]) + "\n")
        log.flush()
        proc = subprocess.Popen(
            [*jvm, "kafka.Kafka", str(p.kafka_props)],
            cwd=p.kafka_dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    write_text_atomic(p.kafka_pid, f"{proc.pid}\n")

    deadline = time.monotonic() + timeout
    seen = ""
    offset = 0
    try:
        while True:
            exit_code = proc.poll()
            if exit_code is not None:
                raise StackError(
                    f"kafka exited with code {exit_code} during start-up", log=p.kafka_log
                )
            with open(p.kafka_log, errors="replace") as fh:
                fh.seek(offset)
                chunk = fh.read()
                offset = fh.tell()
            seen = (seen + chunk)[-4096:]
            if KAFKA_READY_MARKER in seen or KAFKA_READY_MARKER in chunk:
                while time.monotonic() < deadline and not port_open(port):
                    time.sleep(0.2)
                if port_open(port):
                    info(f"kafka ready in {time.monotonic() - t0:.1f}s")
                    return Status("up", proc.pid, port)
            if time.monotonic() > deadline:
                raise StackError(f"kafka not ready after {timeout:.0f}s", log=p.kafka_log)
            time.sleep(0.25)
    except BaseException:
        if proc.poll() is None:
            stop_pid(proc.pid, 10, proc)
        p.kafka_pid.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- commands


def cmd_up(p: Paths, export: bool, secure: bool = False) -> int:
    version = kafka_version()
    want_kport = env_int("MILPA_KAFKA_PORT")
    want_cport = env_int("MILPA_KAFKA_CONTROLLER_PORT")
    want_rport = env_int("MILPA_REDIS_PORT")
    with state_lock(p.dir):
        ks, rs = kafka_status(p), redis_status(p)
        if ks.state == "up" and rs.state == "up":
            running = read_json(p.kafka_json).get("version")
            if running and running != version:
                info(
                    f"note: Kafka {running} is running (wanted {version}); "
                    "run `down` then `up` to switch"
                )
            for name, wanted, st in (
                ("MILPA_KAFKA_PORT", want_kport, ks),
                ("MILPA_REDIS_PORT", want_rport, rs),
            ):
                if wanted and wanted != st.port:
                    info(
                        f"note: already running on port {st.port}; "
                        f"{name}={wanted} ignored (run `down` first)"
                    )
            write_text_atomic(p.env, "\n".join(env_lines(p)) + "\n")
            print_env(env_lines(p), export)
            return 0

        # Pre-flight: fail fast (exit 2) on missing tools before starting anything.
        java = find_java(version) if ks.state != "up" else None
        redis_bin = find_redis(p) if rs.state != "up" else None
        if (
            ks.state != "up"
            and not libs_ready(lib_dir(version), version)
            and not shutil.which("mvn")
        ):
            raise StackError(
                "mvn not found: install Maven (apt-get install -y maven) to resolve the Kafka jars",
                code=2,
            )

        # Stop half-alive leftovers (process alive but not answering).
        for st, pidfile, label, t in (
            (ks, p.kafka_pid, "kafka", KAFKA_STOP_TIMEOUT),
            (rs, p.redis_pid, "redis", REDIS_STOP_TIMEOUT),
        ):
            if st.state == "unhealthy" and st.pid:
                info(f"{label}: {st.detail}; restarting it")
                stop_pid(st.pid, t)
            if st.state != "up":
                pidfile.unlink(missing_ok=True)

        requests = []
        if rs.state != "up":
            requests.append(("MILPA_REDIS_PORT", want_rport))
        if ks.state != "up":
            requests += [
                ("MILPA_KAFKA_PORT", want_kport),
                ("MILPA_KAFKA_CONTROLLER_PORT", want_cport),
            ]
        ports = pick_ports(requests)
        rport = ports.pop(0) if rs.state != "up" else 0
        lib = ensure_kafka_libs(p, version) if java else None

        p.env.unlink(missing_ok=True)
        if redis_bin:
            start_redis(p, redis_bin, rport, secure)
        if java and lib:
            kport, cport = ports
            try:
                start_kafka(
                    p, java=java, lib=lib, version=version, port=kport, cport=cport, secure=secure
                )
            except StackError as exc:
                exc.args = (f"{exc.args[0]} (redis is still running; `stack.py down` stops it)",)
                raise
        write_text_atomic(p.env, "\n".join(env_lines(p)) + "\n")
        print_env(env_lines(p), export)
        return 0


def cmd_down(p: Paths) -> int:
    with state_lock(p.dir):
        for label, status_fn, pidfile, timeout in (
            ("kafka", kafka_status, p.kafka_pid, KAFKA_STOP_TIMEOUT),
            ("redis", redis_status, p.redis_pid, REDIS_STOP_TIMEOUT),
        ):
            st = status_fn(p)
            if st.pid:
                t0 = time.monotonic()
                killed = stop_pid(st.pid, timeout)
                how = "SIGKILL after timeout" if killed else "SIGTERM"
                print(f"{label}: stopped pid {st.pid} ({how}, {time.monotonic() - t0:.1f}s)")
            else:
                print(f"{label}: not running")
            pidfile.unlink(missing_ok=True)
        p.env.unlink(missing_ok=True)
    return 0


def cmd_status(p: Paths) -> int:
    ks, rs = kafka_status(p), redis_status(p)
    kmeta = read_json(p.kafka_json)
    if ks.state == "up":
        print(
            f"kafka: up    pid={ks.pid} bootstrap=127.0.0.1:{ks.port} controller=127.0.0.1:"
            f"{kmeta.get('controller_port')} version={kmeta.get('version')} log={p.kafka_log}"
        )
    else:
        print(f"kafka: {ks.state:<5} {ks.detail}")
    if rs.state == "up":
        print(f"redis: up    pid={rs.pid} url=redis://127.0.0.1:{rs.port}/0 log={p.redis_log}")
    else:
        print(f"redis: {rs.state:<5} {rs.detail}")
    return 0 if ks.state == rs.state == "up" else 1


def cmd_env(p: Paths, export: bool) -> int:
    try:
        lines = [line for line in p.env.read_text().splitlines() if line.strip()]
    except OSError:
        raise StackError(
            f"stack is not up (no {p.env}); run: python3 {Path(sys.argv[0])} up"
        ) from None
    print_env(lines, export)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="stack.py",
        description="Local Kafka (KRaft, from Maven jars) + redis-server for milpa-sessions.",
    )
    ap.add_argument("command", choices=["up", "down", "status", "env"])
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
    args = ap.parse_args(argv)
    p = Paths(args.state_dir.expanduser().resolve())
    try:
        if args.command == "up":
            p.dir.mkdir(parents=True, exist_ok=True)
        if args.command == "up":
            return cmd_up(p, args.export, args.secure)
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
