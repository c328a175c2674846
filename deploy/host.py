"""What the machine and its processes use: CPU from /proc and Redis INFO, py-spy samples and
their summary (self and inclusive time per function, as shares of the samples taken while the
process was busy), and a description of the machine (Linux)."""

from __future__ import annotations

import contextlib
import os
import platform
import pwd
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import redis

from deploy.harness import Proc

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


def _cpu_ticks() -> list[int] | None:
    """The machine's `cpu` line of /proc/stat: user, nice, system, idle, iowait, irq, softirq,
    steal (ticks, all cores); None if unreadable."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return [int(x) for x in fields[1:9]]
    except (OSError, IndexError, ValueError):
        return None


def machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine spent busy (all cores: user, nice, system, irq, steal)."""
    ticks = _cpu_ticks()
    if ticks is None:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / _TICKS


def machine_kernel_seconds() -> tuple[float, float] | None:
    """CPU seconds the whole machine spent on (interrupts + softirqs, steal), all cores: the parts
    of its busy time no process is charged for."""
    ticks = _cpu_ticks()
    if ticks is None:
        return None
    irq, softirq, steal = ticks[5:8]
    return (irq + softirq) / _TICKS, steal / _TICKS


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


# HotSpot's performance counters (what `jstat` reads): a file per JVM, /tmp/hsperfdata_<user>/<pid>.
_HSPERF_DIR = Path("/tmp")
_HSPERF_MAGIC = b"\xca\xfe\xc0\xc0"
_HSPERF_COUNTERS = ("java.ci.totalTime", "sun.os.hrt.frequency")
_HSPERF_GC = re.compile(r"sun\.gc\.collector\.\d+\.time")


@dataclass(frozen=True)
class JvmTimes:
    """Seconds a JVM has spent compiling (its JIT, summed over compilations) and in its
    collectors' pauses since it started, as `jstat -compiler` / `jstat -gcutil` report them:
    elapsed time, not CPU time (a compiler thread waiting for a core counts; a collector's
    concurrent work does not)."""

    compile_s: float
    gc_s: float


def jvm_times(pid: int) -> JvmTimes | None:
    """`JvmTimes` of a HotSpot JVM on this machine, read from its performance-counter file
    (no JVM started, unlike `jstat`); None if there is none (not a JVM of this machine, another
    user's, or started with -XX:-UsePerfData) or it does not parse."""
    try:
        owner = pwd.getpwuid(Path(f"/proc/{pid}").stat().st_uid).pw_name
        counters = _hsperf_longs((_HSPERF_DIR / f"hsperfdata_{owner}" / str(pid)).read_bytes())
    except (OSError, KeyError, struct.error, ValueError):
        return None
    frequency = counters.get("sun.os.hrt.frequency")
    compiled = counters.get("java.ci.totalTime")
    if not frequency or compiled is None:
        return None
    gc = sum(v for k, v in counters.items() if _HSPERF_GC.fullmatch(k))
    return JvmTimes(compiled / frequency, gc / frequency)


def _hsperf_longs(data: bytes) -> dict[str, int]:
    """The scalar long counters of an hsperfdata file: its prologue (magic, byte order, ...,
    entry offset and count at bytes 24-31), then entries (length, name offset, vector length,
    type, flags, units, variability, data offset). Raises ValueError if it is not one."""
    if data[:4] != _HSPERF_MAGIC:
        raise ValueError("not an hsperfdata file")
    order = "<" if data[4] == 1 else ">"
    at, count = struct.unpack_from(order + "ii", data, 24)
    out: dict[str, int] = {}
    for _ in range(count):
        length, name_at, vector, kind, _f, _u, _v, data_at = struct.unpack_from(
            order + "iiicccci", data, at
        )
        if length <= 0:  # counted before it is filled in (the JVM adds one now): the end
            break
        end = data.index(b"\0", at + name_at)
        if kind == b"J" and vector == 0:
            out[data[at + name_at : end].decode("ascii", "replace")] = struct.unpack_from(
                order + "q", data, at + data_at
            )[0]
        at += length
    return out


@dataclass
class CpuMeter:
    """CPU used between `start()` and `stop()`, as % of one core: the named processes, Redis,
    this process ("harness"), the whole machine, and what other processes used."""

    pids: dict[str, int]
    redis_client: redis.Redis | None = None
    quiet_pids: set[int] = field(default_factory=set)  # ours, but not reported (redis-server)
    # Named groups of processes reported as one (the brokers of a cluster, its Redis masters).
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # JVMs (the brokers) whose JIT and collector seconds are reported too: `<name>_jit_s`, `_gc_s`.
    jvms: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _start: dict[str, float | None] = field(default_factory=dict)
    _jvm_start: dict[str, JvmTimes | None] = field(default_factory=dict)
    _procs: dict[int, tuple[str, float]] = field(default_factory=dict)
    _t0: float = 0.0
    _quiet: float = 0.0
    _kernel: tuple[float, float] | None = None

    def _sample(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        for name, pids in self.groups.items():
            used = [cpu_seconds(pid) for pid in pids]
            out[name] = None if None in used else sum(u or 0.0 for u in used)
        if self.redis_client is not None:
            out["redis"] = redis_cpu_seconds(self.redis_client)
        out["harness"] = cpu_seconds(os.getpid())
        times = os.times()  # processes the harness forked and reaped (replay's rebuild processes)
        out["harness_children"] = times.children_user + times.children_system
        out["machine"] = machine_busy_seconds()
        return out

    def _quiet_seconds(self) -> float:
        return sum(cpu_seconds(pid) or 0.0 for pid in self.quiet_pids)

    def start(self) -> None:
        """Take the first sample."""
        self._t0 = time.monotonic()
        self._start = self._sample()
        self._quiet = self._quiet_seconds()
        self._kernel = machine_kernel_seconds()
        self._procs = all_processes()
        self._jvm_start = {name: _jvm_sum(pids) for name, pids in self.jvms.items()}

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
        grouped = (pid for pids in self.groups.values() for pid in pids)
        ours = {os.getpid(), *self.pids.values(), *self.quiet_pids, *grouped}
        others = []
        for pid, (cmd, after) in procs.items():
            if pid in ours or pid not in self._procs or elapsed <= 0:
                continue
            pct = 100 * (after - self._procs[pid][1]) / elapsed
            if pct >= 5:
                others.append((round(pct, 1), cmd))
        others.sort(reverse=True)
        out["other_processes_cpu_pct"] = [[pct, cmd] for pct, cmd in others[:4]]
        # What the machine was busy with beyond the processes accounted for above (and the quiet
        # ones): short-lived processes, other tenants (steal), the kernel's own work.
        machine = out.get("machine_cpu_pct")
        if machine is not None and elapsed > 0:
            accounted = sum(
                v
                for k, v in out.items()
                if k.endswith("_cpu_pct") and k != "machine_cpu_pct" and isinstance(v, float)
            )
            # The quiet processes (redis-server) count unless already reported (through INFO).
            quiet = 0.0
            if out.get("redis_cpu_pct") is None:
                quiet = 100 * (self._quiet_seconds() - self._quiet) / elapsed
            out["unaccounted_cpu_pct"] = round(machine - accounted - quiet, 1)
            # Of which: interrupts and softirqs (the loopback traffic of the processes measured
            # lands here too) and steal (other tenants of the host), so a reader can tell them.
            kernel = machine_kernel_seconds()
            if kernel is not None and self._kernel is not None:
                out["unaccounted_of_which"] = {
                    "irq_softirq_cpu_pct": round(100 * (kernel[0] - self._kernel[0]) / elapsed, 1),
                    "steal_cpu_pct": round(100 * (kernel[1] - self._kernel[1]) / elapsed, 1),
                }
        for name, pids in self.jvms.items():
            first, last = self._jvm_start.get(name), _jvm_sum(pids)
            if first is None or last is None:
                out[f"{name}_jit_s"] = out[f"{name}_gc_s"] = None
            else:
                out[f"{name}_jit_s"] = round(last.compile_s - first.compile_s, 2)
                out[f"{name}_gc_s"] = round(last.gc_s - first.gc_s, 3)
        out["loadavg_1m"] = round(os.getloadavg()[0], 2)
        return out


def _jvm_sum(pids: Sequence[int]) -> JvmTimes | None:
    """`jvm_times` summed over `pids` (a cluster's brokers); None if any is unknown."""
    times = [jvm_times(pid) for pid in pids]
    if not times or None in times:
        return None
    return JvmTimes(sum(t.compile_s for t in times if t), sum(t.gc_s for t in times if t))


def cpu_report(params: dict[str, Any]) -> dict[str, Any]:
    """The `CpuMeter.stop()` report among a figure's params: each process's CPU, the JVMs' JIT
    and collector seconds, what else ran, the load average."""
    keys = ("other_processes_cpu_pct", "unaccounted_of_which", "loadavg_1m")
    return {
        k: v for k, v in params.items() if k.endswith(("_cpu_pct", "_jit_s", "_gc_s")) or k in keys
    }


# A figure measured in rounds lists each measured round's report under a key named so
# (`rounds_cpu_pct`); other lists of reports (a warm-up's throwaway rounds) are not read.
ROUNDS_PREFIX = "rounds_"


def _reports(params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`params` and every dict in it, at any depth: in nested dicts and in a figure's measured
    rounds (lists under keys named `rounds_…`; a warm-up's throwaway rounds are not read)."""
    yield params
    for key, value in params.items():
        if isinstance(value, dict):
            yield from _reports(value)
        elif key.startswith(ROUNDS_PREFIX) and isinstance(value, list):
            for report in value:
                if isinstance(report, dict):
                    yield from _reports(report)


def others_cpu(params: dict[str, Any]) -> float:
    """The most CPU other processes used (% of a core) in any one `CpuMeter.stop()` report in
    `params`, at any depth and in any measured round (a round's report is also among the
    figure's own params when it is the median one: a sum would count it twice)."""
    return max(
        (
            sum(float(pct) for pct, _ in listed)
            for report in _reports(params)
            if isinstance(listed := report.get("other_processes_cpu_pct"), list)
        ),
        default=0.0,
    )


def unaccounted_cpu(params: dict[str, Any]) -> float:
    """The most CPU (% of a core) any `CpuMeter.stop()` report in `params` found the machine busy
    with beyond the processes it accounts for, at any depth and in any measured round (0 without
    a report)."""
    return worst_unaccounted(params)[0]


def worst_unaccounted(params: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """`unaccounted_cpu(params)` and, from the same report, how much of it was interrupts and
    softirqs and how much steal (`unaccounted_of_which`; empty if not known)."""
    found: tuple[float, dict[str, float]] = (0.0, {})
    for report in _reports(params):
        value = report.get("unaccounted_cpu_pct")
        if isinstance(value, int | float) and float(value) > found[0]:
            parts = report.get("unaccounted_of_which")
            found = (float(value), dict(parts) if isinstance(parts, dict) else {})
    return found


# -- sampling with py-spy --------------------------------------------------------------------------


def py_spy_binary() -> str | None:
    """py-spy next to this interpreter, or on PATH."""
    here = Path(sys.executable).with_name("py-spy")
    if here.exists():
        return str(here)
    return shutil.which("py-spy")


@dataclass
class PySpy:
    """A running `py-spy record` on one PID; `stop()` makes it write its output (SIGINT)."""

    proc: Proc
    output: Path

    @property
    def log(self) -> Path:
        """What py-spy itself printed."""
        return self.proc.log_path

    @classmethod
    def start(cls, pid: int, output: Path, rate: int = 100) -> PySpy | None:
        """Start sampling `pid` at `rate` Hz (non-blocking: the target is not paused)."""
        binary = py_spy_binary()
        if binary is None:
            return None
        argv = [binary, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw"]
        argv += ["--nonblocking", "--output", str(output)]
        log = output.with_suffix(".py-spy.log")
        return cls(Proc.start("py-spy", argv, log, new_session=True), output)

    def stop(self, timeout: float = 20.0) -> Path | None:
        """Stop sampling and return the raw output file (None if py-spy wrote nothing)."""
        self.proc.stop(timeout, signal.SIGINT)
        return self.output if self.output.exists() else None


# py-spy's raw format: collapsed stacks, `frame;frame;... count`, outermost frame first.
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::(?P<line>\d+))?\)$")


def frame_name(frame: str) -> str:
    """`function (path)` of a py-spy frame; the path from site-packages, the stdlib or the repo."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    for marker in ("site-packages/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        path = path.rsplit("/main/", 1)[-1]
    return f"{m.group('func')} ({path})"


@dataclass(frozen=True)
class ProfileSummary:
    """Self and inclusive shares per function, and shares per category."""

    samples: int
    self_share: list[tuple[str, float]]
    inclusive_share: list[tuple[str, float]]
    categories: list[tuple[str, float]]
    ours: tuple[str, ...] = ()  # path prefixes of the code whose inclusive time is listed

    def render(self, top: int = 25) -> str:
        """A readable report."""
        lines = [f"{self.samples} samples (busy threads only)", "", "by category:"]
        lines += [f"  {share:5.1f}%  {name}" for name, share in self.categories]
        lines += ["", "self time:"]
        lines += [f"  {share:5.1f}%  {name}" for name, share in self.self_share[:top]]
        lines += ["", "inclusive time (project code):"]
        ours = [(n, s) for n, s in self.inclusive_share if any(f"({p}" in n for p in self.ours)]
        lines += [f"  {share:5.1f}%  {name}" for name, share in ours[:top]]
        return "\n".join(lines)


def summarize_py_spy(
    raw: str,
    categorize: Callable[[list[str]], str],
    ours: tuple[str, ...] = (),
    exclude_threads: tuple[str, ...] = (),
) -> ProfileSummary:
    """Summarise py-spy's raw collapsed stacks; `categorize` names the category of a stack."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    by_category: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = [f for f in stack.split(";") if f]
        if frames and any(frames[0].startswith(t) for t in exclude_threads):
            continue
        names = [frame_name(f) for f in frames if not f.startswith(("process ", "thread "))]
        if not names:
            continue
        n = int(count_text)
        total += n
        own[names[-1]] += n
        by_category[categorize(names)] += n
        for name in set(names):
            inclusive[name] += n
    if total == 0:
        return ProfileSummary(0, [], [], [], ours)
    return ProfileSummary(
        total,
        [(name, 100 * n / total) for name, n in own.most_common()],
        [(name, 100 * n / total) for name, n in inclusive.most_common()],
        [(name, 100 * n / total) for name, n in by_category.most_common()],
        ours,
    )


# -- the machine -----------------------------------------------------------------------------------


def _proc_line(path: str, name: str) -> str | None:
    """The value of the first `name: value` line of a /proc file."""
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    return None


def git_state(root: Path, paths: Sequence[str]) -> dict[str, object]:
    """The commit checked out in `root` and the files under `paths` changed on top of it."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=False, timeout=10
        )
        return done.stdout.rstrip("\n")

    try:
        changed = git("status", "--porcelain", "--", *paths).splitlines()
        return {"commit": git("rev-parse", "--short", "HEAD"), "uncommitted": changed}
    except (OSError, subprocess.SubprocessError):
        return {}


def describe_machine(distributions: Sequence[str] = ()) -> dict[str, object]:
    """nproc, CPU model, memory, kernel, the versions of Python and of these distributions."""
    memory = _proc_line("/proc/meminfo", "MemTotal")
    versions: dict[str, str] = {"python": platform.python_version()}
    for dist in distributions:
        with contextlib.suppress(PackageNotFoundError):
            versions[dist] = version(dist)
    return {
        "nproc": os.cpu_count(),
        "cpu": _proc_line("/proc/cpuinfo", "model name") or "unknown",
        "mem_gib": None if memory is None else round(int(memory.split()[0]) / 1024**2, 1),
        "kernel": platform.release(),
        "versions": versions,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
