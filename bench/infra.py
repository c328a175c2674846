"""The harness's plumbing: the stack, worker processes, topics, Redis prefixes, CPU accounting.

Everything a figure starts is registered with a `Cleanup` and undone in reverse order, on success,
on failure and on Ctrl-C (SIGINT/SIGTERM become KeyboardInterrupt in the main thread): worker
processes are stopped (SIGTERM, then SIGKILL), Redis keys under the run's prefixes unlinked, the
run's topics and consumer groups deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient

from milpa_sessions.settings import Settings
from producers.topics import delete_topics, ensure_topics
from projections.keys import Keys

REPO = Path(__file__).resolve().parents[1]
# Faust reads these from the environment; a dead member must not hold a partition for a minute.
FAST_GROUP_ENV = {
    "BROKER_SESSION_TIMEOUT": "6",
    "BROKER_HEARTBEAT_INTERVAL": "1",
    "BROKER_REBALANCE_TIMEOUT": "20",
}


# -- the stack -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    """Where Kafka and Redis are, and the PIDs of their servers when known (for CPU accounting)."""

    kafka_bootstrap: str
    redis_url: str
    source: str
    kafka_pid: int | None = None
    redis_pid: int | None = None


def _reachable(bootstrap: str, url: str) -> bool:
    host, _, port = bootstrap.split(",", maxsplit=1)[0].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            pass
        return bool(redis.Redis.from_url(url, socket_timeout=2).ping())
    except (OSError, ValueError, redis.RedisError):
        return False


def _read_env(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    return dict(
        line.split("=", 1)
        for line in path.read_text().splitlines()
        if "=" in line and line[0] != "#"
    )


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def ensure_stack(log: Callable[[str], None]) -> Stack:
    """MILPA_KAFKA_BOOTSTRAP/MILPA_REDIS_URL if set and reachable, else `deploy/stack.py up`.

    `up` is idempotent: it reuses a running stack. The harness never stops the stack.
    """
    state = Path(os.environ.get("MILPA_STACK_DIR", REPO / "deploy" / ".run"))
    kafka_pid = _pid(state / "kafka.pid")
    bootstrap, url = os.environ.get("MILPA_KAFKA_BOOTSTRAP"), os.environ.get("MILPA_REDIS_URL")
    if bootstrap and url and _reachable(bootstrap, url):
        return Stack(bootstrap, url, "environment", kafka_pid, _pid(state / "redis.pid"))
    log("starting or reusing the local stack: python3 deploy/stack.py up")
    done = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "stack.py"), "up"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"deploy/stack.py up failed:\n{done.stdout}\n{done.stderr}")
    values = _read_env(state / "stack.env")
    bootstrap, url = values.get("MILPA_KAFKA_BOOTSTRAP"), values.get("MILPA_REDIS_URL")
    if not bootstrap or not url or not _reachable(bootstrap, url):
        raise RuntimeError(f"the stack is not reachable after `up` (env file {state}/stack.env)")
    return Stack(
        bootstrap, url, "deploy/stack.py", _pid(state / "kafka.pid"), _pid(state / "redis.pid")
    )


def server_versions(stack: Stack) -> dict[str, str]:
    """Kafka's version (from deploy/stack.py's state, when it started it) and Redis's."""
    out: dict[str, str] = {}
    state = Path(os.environ.get("MILPA_STACK_DIR", REPO / "deploy" / ".run"))
    with contextlib.suppress(OSError, ValueError, KeyError):
        out["kafka"] = str(json.loads((state / "kafka.json").read_text())["version"])
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
    """Turn SIGTERM into KeyboardInterrupt, so `finally` blocks stop the workers."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


# -- per-figure names ------------------------------------------------------------------------------


def figure_settings(stack: Stack, tag: str, name: str, **changes: Any) -> Settings:
    """Settings (the product's defaults) with this figure's own topics, group and key prefix."""
    base = f"bench-{tag}-{name}"
    s = Settings(
        kafka_bootstrap=stack.kafka_bootstrap,
        redis_url=stack.redis_url,
        redis_prefix=f"bench{tag}{name}",
        events_topic=f"{base}-events",
        decisions_topic=f"{base}-decisions",
        deadletter_topic=f"{base}-deadletter",
        consumer_group=f"{base}-group",
    )
    return replace(s, **changes)


def create_topics(settings: Settings, cleanup: Cleanup) -> None:
    """Create the figure's topics; delete them (and its group's internal topics) at cleanup."""
    ensure_topics(settings)
    cleanup.push(f"delete topics of {settings.events_topic}", lambda: delete_topics(settings))


def clear_prefix(url: str, prefix: str) -> int:
    """Unlink every key under `prefix:`; returns how many."""
    client = redis.Redis.from_url(url)
    try:
        n = 0
        batch: list[bytes] = []
        for key in client.scan_iter(match=Keys(prefix).pattern(), count=5000):
            batch.append(key)
            if len(batch) >= 5000:
                n += client.unlink(*batch)
                batch = []
        if batch:
            n += client.unlink(*batch)
        return n
    finally:
        client.close()


def register_prefix(settings: Settings, cleanup: Cleanup) -> None:
    """Clear the figure's Redis keys at cleanup."""
    cleanup.push(
        f"clear redis prefix {settings.redis_prefix}",
        lambda: clear_prefix(settings.redis_url, settings.redis_prefix),
    )


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """partition → end offset of `topic`."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap.split(","), group_id=None)
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        ends = consumer.end_offsets([TopicPartition(topic, p) for p in parts])
        return {tp.partition: off for tp, off in ends.items()}
    finally:
        consumer.close()


def group_members(bootstrap: str, group: str, topic: str) -> tuple[str, dict[str, set[int]]]:
    """The group's state and member id → partitions of `topic` it owns."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","))
    try:
        described = admin.describe_groups([group])[group]
    finally:
        admin.close()
    members: dict[str, set[int]] = {}
    for member in described.get("members") or []:
        assignment = member.get("member_assignment") or {}
        members[member["member_id"]] = {
            p
            for t in assignment.get("assigned_partitions", [])
            if t["topic"] == topic
            for p in t["partitions"]
        }
    return str(described.get("group_state")), members


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- worker processes ----------------------------------------------------------------------------


@dataclass
class Proc:
    """A worker process the harness started (own process group, own working directory)."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int = 0

    @property
    def pid(self) -> int:
        """Its PID."""
        return self.proc.pid

    def alive(self) -> bool:
        """Still running."""
        return self.proc.poll() is None

    def log(self, tail: int = 4000) -> str:
        """The end of what it printed."""
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (graceful: it leaves the group), SIGKILL if it hangs; only this process."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def metrics(self, timeout: float = 5.0) -> str:
        """Its Prometheus exposition ('' without a metrics port)."""
        if not self.metrics_port:
            return ""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body: bytes = response.read()
        return body.decode()


@dataclass
class Procs:
    """Starts worker processes and registers their stop with a cleanup."""

    cleanup: Cleanup
    workdir: Path
    started: list[Proc] = field(default_factory=list)

    def start(
        self,
        name: str,
        settings: Settings,
        *,
        module: str = "milpa_sessions.cli",
        loglevel: str = "info",
        metrics: bool = True,
        command: str = "worker",
    ) -> Proc:
        """Start `python -m <module> <command>` with the settings in its environment.

        The working directory is a scratch directory, so Faust's `<app>-data` directory does not
        land in the repository.
        """
        port = free_port() if metrics else 0
        if metrics:
            settings = replace(settings, metrics_port=port)
        env = {
            **os.environ,
            **settings.to_env(),
            **FAST_GROUP_ENV,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        cwd = self.workdir / name
        cwd.mkdir(parents=True, exist_ok=True)
        log_path = cwd / "worker.log"
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, command, "--loglevel", loglevel],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                start_new_session=True,  # Ctrl-C in the terminal reaches the harness only
            )
        p = Proc(name, proc, log_path, port)
        self.started.append(p)
        self.cleanup.push(f"stop worker {name} (pid {p.pid})", p.stop)
        return p


def scratch_dir(cleanup: Cleanup, keep: bool = False) -> Path:
    """A scratch directory for worker working dirs and logs (removed at the end unless kept)."""
    path = Path(tempfile.mkdtemp(prefix="milpa-bench-"))
    if not keep:
        import shutil  # noqa: PLC0415

        cleanup.push(f"remove {path}", lambda: shutil.rmtree(path, ignore_errors=True))
    return path


# -- CPU accounting ------------------------------------------------------------------------------


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used (Linux /proc), None if unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS


def redis_cpu_seconds(client: redis.Redis) -> float | None:
    """used_cpu_user + used_cpu_sys of the Redis server."""
    try:
        info = client.info("cpu")
    except redis.RedisError:
        return None
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine spent busy (all cores: user, nice, system, irq, steal)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICKS


def all_processes() -> dict[int, tuple[str, float]]:
    """pid → (command line, CPU seconds) of every process."""
    out: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        used = cpu_seconds(pid)
        if used is None:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[pid] = (cmd.strip()[:80] or entry.name, used)
    return out


@dataclass
class CpuMeter:
    """CPU used between `start()` and `stop()`, as % of one core: the named processes, Redis,
    the harness, the whole machine, and what other processes (not the benchmark's) used."""

    pids: dict[str, int]
    redis_client: redis.Redis | None = None
    quiet_pids: set[int] = field(default_factory=set)  # ours, but not reported (redis-server)
    _start: dict[str, float | None] = field(default_factory=dict)
    _procs: dict[int, tuple[str, float]] = field(default_factory=dict)
    _t0: float = 0.0

    def _sample(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        if self.redis_client is not None:
            out["redis"] = redis_cpu_seconds(self.redis_client)
        out["harness"] = cpu_seconds(os.getpid())
        out["machine"] = machine_busy_seconds()
        return out

    def start(self) -> None:
        """Take the first sample."""
        self._t0 = time.monotonic()
        self._start = self._sample()
        self._procs = all_processes()

    def stop(self) -> dict[str, Any]:
        """% of one core each used since `start()`, the machine's busy %, others' top users."""
        elapsed = time.monotonic() - self._t0
        end = self._sample()
        procs = all_processes()
        out: dict[str, Any] = {}
        for name, before in self._start.items():
            after = end.get(name)
            out[f"{name}_cpu_pct"] = (
                None
                if before is None or after is None or elapsed <= 0
                else round(100 * (after - before) / elapsed, 1)
            )
        ours = {os.getpid(), *self.pids.values(), *self.quiet_pids}
        others = []
        for pid, (cmd, after) in procs.items():
            if pid in ours or pid not in self._procs or elapsed <= 0:
                continue
            pct = 100 * (after - self._procs[pid][1]) / elapsed
            if pct >= 5:
                others.append((round(pct, 1), cmd))
        others.sort(reverse=True)
        out["other_processes_cpu_pct"] = [[pct, cmd] for pct, cmd in others[:4]]
        out["loadavg_1m"] = round(os.getloadavg()[0], 2)
        return out


def wait_for(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    interval: float = 0.1,
    procs: Sequence[Proc] = (),
) -> None:
    """Poll until `predicate()`; fail with the workers' logs if one died or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{what}: worker {p.name} died\n{p.log()}")
        time.sleep(interval)
    logs = "".join(f"\n--- {p.name}\n{p.log(2000)}" for p in procs)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s{logs}")
