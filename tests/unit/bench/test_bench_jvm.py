"""The broker's JIT and collector seconds (HotSpot's performance counters), and the e2e figure's
throwaway rounds until the broker has stopped compiling."""

from __future__ import annotations

import getpass
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from bench.figures.e2e import WARM_ROUNDS_MAX, E2e, warm_broker
from deploy import host
from deploy.host import CpuMeter, JvmTimes, jvm_times

PID = os.getpid()  # (the owner of a pid names the counters' folder: this process's is ours)
FREQUENCY = 1_000_000_000  # ticks per second


def _hsperf(longs: dict[str, int], order: str = "<", text: dict[str, str] | None = None) -> bytes:
    """An hsperfdata file as HotSpot lays it out: a 32-byte prologue, then the entries."""
    entries = b""
    for name, value in longs.items():
        entries += _entry(order, name, b"J", 0, struct.pack(order + "q", value))
    for name, value in (text or {}).items():
        data = value.encode() + b"\0"
        entries += _entry(order, name, b"B", len(data), data)
    count = len(longs) + len(text or {})
    prologue = b"\xca\xfe\xc0\xc0" + bytes([1 if order == "<" else 0, 2, 0, 1])
    prologue += struct.pack(order + "iiqii", 32 + len(entries), 0, 0, 32, count)
    return prologue + entries


def _entry(order: str, name: str, kind: bytes, vector: int, data: bytes) -> bytes:
    header = struct.calcsize(order + "iiicccci")
    raw_name = name.encode() + b"\0"
    pad = b"\0" * (-(header + len(raw_name)) % 8)
    data_at = header + len(raw_name) + len(pad)
    length = data_at + len(data) + (-len(data) % 8)
    fields = (length, header, vector, kind, b"\0", b"\0", b"\0", data_at)
    out = struct.pack(order + "iiicccci", *fields) + raw_name + pad + data
    return out + b"\0" * (length - len(out))


def _counters(compiled_s: float, gc_s: tuple[float, ...]) -> dict[str, int]:
    longs = {"sun.os.hrt.frequency": FREQUENCY, "java.ci.totalTime": int(compiled_s * FREQUENCY)}
    for i, seconds in enumerate(gc_s):
        longs[f"sun.gc.collector.{i}.time"] = int(seconds * FREQUENCY)
        longs[f"sun.gc.collector.{i}.invocations"] = 7  # a count, not a time: left out
    return longs


@pytest.fixture
def perf_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(host, "_HSPERF_DIR", tmp_path)
    folder = tmp_path / f"hsperfdata_{getpass.getuser()}"
    folder.mkdir()
    return folder


@pytest.mark.parametrize("order", ["<", ">"])
def test_the_compile_and_collector_seconds_are_read_from_the_counters(
    perf_dir: Path, order: str
) -> None:
    text = {"sun.rt.javaCommand": "kafka.Kafka server.properties"}
    (perf_dir / str(PID)).write_bytes(_hsperf(_counters(12.5, (0.25, 0.5)), order, text))
    assert jvm_times(PID) == JvmTimes(12.5, 0.75)


def test_an_entry_counted_but_not_filled_in_yet_ends_the_list(perf_dir: Path) -> None:
    whole = _hsperf(_counters(2.0, (0.5,)))
    count_at = 28  # the prologue's entry count: one more than there are, the last all zeros
    count = struct.unpack_from("<i", whole, count_at)[0]
    torn = whole[:count_at] + struct.pack("<i", count + 1) + whole[count_at + 4 :] + bytes(64)
    (perf_dir / str(PID)).write_bytes(torn)
    assert jvm_times(PID) == JvmTimes(2.0, 0.5)


def test_no_counters_read_as_unknown(perf_dir: Path) -> None:
    assert jvm_times(PID) is None  # no file: not a JVM of this machine
    (perf_dir / str(PID)).write_bytes(b"not a perf file at all, but long enough to read" * 2)
    assert jvm_times(PID) is None
    whole = _hsperf(_counters(1.0, (0.1,)))
    (perf_dir / str(PID)).write_bytes(whole[:40])  # cut inside the entries
    assert jvm_times(PID) is None
    no_compiler = {"sun.os.hrt.frequency": FREQUENCY}
    (perf_dir / str(PID)).write_bytes(_hsperf(no_compiler))
    assert jvm_times(PID) is None


def test_a_cpu_meter_reports_what_the_jvm_compiled_and_collected_meanwhile(perf_dir: Path) -> None:
    path = perf_dir / str(PID)
    path.write_bytes(_hsperf(_counters(10.0, (1.0,))))
    meter = CpuMeter({}, jvms={"kafka": (PID,)})
    meter.start()
    path.write_bytes(_hsperf(_counters(13.25, (1.125,))))
    report = meter.stop()
    assert report["kafka_jit_s"] == 3.25
    assert report["kafka_gc_s"] == 0.125


def test_a_cluster_sums_its_brokers_and_one_unknown_makes_it_unknown(perf_dir: Path) -> None:
    one, two = os.getpid(), os.getppid()  # two processes of ours stand for two brokers
    (perf_dir / str(one)).write_bytes(_hsperf(_counters(1.0, (0.5,))))
    (perf_dir / str(two)).write_bytes(_hsperf(_counters(2.0, (0.25,))))
    meter = CpuMeter({}, jvms={"kafka": (one, two), "other": (one, 2**22 + 1)})
    meter.start()
    (perf_dir / str(two)).write_bytes(_hsperf(_counters(4.0, (0.25,))))
    report = meter.stop()
    assert report["kafka_jit_s"] == 2.0
    assert report["other_jit_s"] is None
    assert report["other_gc_s"] is None


class _Run:
    """What `warm_broker` uses of a run: settle between rounds, log."""

    def __init__(self) -> None:
        self.settled = 0
        self.logged: list[str] = []

    def settle(self, max_s: float) -> tuple[float, dict[str, float]]:
        self.settled += 1
        return 0.0, {}

    def log(self, line: str) -> None:
        self.logged.append(line)


def _rounds(jit: list[float | None]) -> tuple[list[str], Any]:
    names: list[str] = []

    def measure(run: Any, name: str) -> E2e:
        i = len(names)
        names.append(name)
        params = {
            "kafka_cpu_pct": 40.0 - i,
            "kafka_jit_s": jit[i],
            "worker0_cpu_pct": 30.0,
            "produced_in_s": 10.0,
        }
        return E2e({"p99": 20.0 - i}, {"p99": 9.0}, {"p99": 10.0}, None, params)

    return names, measure


def test_throwaway_rounds_run_until_the_broker_stops_compiling() -> None:
    run = _Run()
    names, measure = _rounds([6.0, 1.2, 0.3, 0.1])  # 5 % of a 10-s window: 0.5 s
    warm = warm_broker(run, "w", measure)  # type: ignore[arg-type]
    assert names == ["w0", "w1", "w2"]
    assert [r["kafka_jit_s"] for r in warm["rounds"]] == [6.0, 1.2, 0.3]
    assert [r["e2e_p99_ms"] for r in warm["rounds"]] == [20.0, 19.0, 18.0]
    assert warm["rounds"][0]["ratio"] == 2.0
    assert warm["broker_still_compiling"] is False
    assert run.settled == 2  # between the rounds (the caller settles before the measured ones)

    names, measure = _rounds([6.0, 0.4, 9.0])  # warm after the second
    warm = warm_broker(_Run(), "w", measure)  # type: ignore[arg-type]
    assert names == ["w0", "w1"] and warm["broker_still_compiling"] is False


def test_a_warm_broker_costs_one_round_and_a_cold_one_at_most_the_cap() -> None:
    cases = (([0.2], 1, False), ([None], 1, None), ([9.0] * 10, WARM_ROUNDS_MAX, True))
    for jit, rounds, compiling in cases:
        # None: not known (a broker in a container, say): one round, and said so
        _, measure = _rounds(jit)
        warm = warm_broker(_Run(), "w", measure)  # type: ignore[arg-type]
        assert len(warm["rounds"]) == rounds
        assert warm["broker_still_compiling"] is compiling
