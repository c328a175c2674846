"""Figures are flagged when the machine was busy with work the harness does not account for."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.figures import CALIBRATION, FIGURES
from bench.figures.common import DISTURBED_PCT, Run, Sizes
from bench.stats import Figure
from deploy.host import CpuMeter, others_cpu, unaccounted_cpu, worst_unaccounted


def test_unaccounted_cpu_is_the_largest_report_at_any_depth() -> None:
    params = {
        "unaccounted_cpu_pct": 3.0,
        "rounds": {"one": {"unaccounted_cpu_pct": 25.5}, "two": {"unaccounted_cpu_pct": 7}},
    }
    assert unaccounted_cpu(params) == 25.5
    assert unaccounted_cpu({"worker_cpu_pct": 99.0}) == 0.0


def _run(emitted: list[Figure]) -> Run:
    return Run(
        stack=None,  # type: ignore[arg-type] # put() touches neither the stack nor the cleanup
        tag="t",
        sizes=Sizes.quick(),
        cleanup=None,  # type: ignore[arg-type]
        root=None,  # type: ignore[arg-type]
        workdir=Path("."),
        log=lambda _: None,
        emit=emitted.append,
    )


def _put(usage: dict[str, Any]) -> Figure:
    emitted: list[Figure] = []
    _run(emitted).put("f", 1.0, "x", params={"cpu": usage})
    (figure,) = emitted
    return figure


def test_a_figure_is_disturbed_when_the_machine_was_busy_beyond_what_is_measured() -> None:
    busy = _put({"worker_cpu_pct": 90.0, "unaccounted_cpu_pct": DISTURBED_PCT + 1})
    assert "beyond the processes measured" in busy.params["disturbed"]
    quiet = _put({"worker_cpu_pct": 90.0, "unaccounted_cpu_pct": DISTURBED_PCT - 1})
    assert "disturbed" not in quiet.params


def test_the_flag_names_the_steal_and_the_interrupts_of_the_worst_report() -> None:
    usage = {
        "a": {"unaccounted_cpu_pct": 5.0, "unaccounted_of_which": {"steal_cpu_pct": 5.0}},
        "b": {
            "unaccounted_cpu_pct": 30.0,
            "unaccounted_of_which": {"steal_cpu_pct": 22.0, "irq_softirq_cpu_pct": 6.0},
        },
    }
    assert worst_unaccounted(usage) == (30.0, {"steal_cpu_pct": 22.0, "irq_softirq_cpu_pct": 6.0})
    flag = _put(usage).params["disturbed"]
    assert "busy 30% of a core" in flag
    assert "steal 22%, interrupts and softirqs 6%" in flag


def test_a_cpu_meter_reports_the_kernel_parts_of_what_it_could_not_account_for() -> None:
    meter = CpuMeter({})
    meter.start()
    sum(i * i for i in range(200_000))  # some time passes, on this process (the harness)
    report = meter.stop()
    parts = report["unaccounted_of_which"]
    assert set(parts) == {"irq_softirq_cpu_pct", "steal_cpu_pct"}
    assert all(v >= 0 for v in parts.values())


def test_named_other_processes_still_disturb_a_figure() -> None:
    usage = {"other_processes_cpu_pct": [[15.0, "a"], [10.0, "b"]], "unaccounted_cpu_pct": 0.0}
    assert others_cpu({"cpu": usage}) == 25.0
    assert "other processes used 25%" in _put(usage).params["disturbed"]


def test_the_calibration_is_a_figure_of_its_own_listed_first() -> None:
    assert next(iter(FIGURES)) == CALIBRATION


def test_a_settle_waits_for_the_rest_of_the_machine_too(monkeypatch: Any) -> None:
    # The servers at rest from the first sample, the machine busy beyond them (an earlier
    # figure's disk writes, say) for two more: it waits those out.
    run = _run([])
    samples = iter([({"kafka_cpu_pct": 2.0}, beyond) for beyond in (40.0, 25.0, 3.0)])
    taken: list[int] = []

    def at_rest(seconds: float, client: Any = None) -> tuple[dict[str, float], float]:
        taken.append(1)
        return next(samples)

    monkeypatch.setattr(run, "_at_rest", at_rest)
    monkeypatch.setattr(run, "redis", lambda: None)
    waited, last = run.settle(60)
    assert len(taken) == 3 and last == {"kafka_cpu_pct": 2.0, "beyond_cpu_pct": 3.0}
    assert waited < 60


def test_the_rest_of_the_machine_counts_other_processes_once(monkeypatch: Any) -> None:
    # `unaccounted_cpu_pct` holds what other processes used (nothing subtracts them from it).
    class Meter:
        def start(self) -> None: ...

        def stop(self) -> dict[str, Any]:
            return {
                "kafka_cpu_pct": 3.0,
                "other_processes_cpu_pct": [[15.0, "some other process"]],
                "unaccounted_cpu_pct": 16.0,
            }

    run = _run([])
    monkeypatch.setattr(run, "cpu", lambda pids, client=None: Meter())
    monkeypatch.setattr(run, "redis", lambda: None)
    monkeypatch.setattr(time, "sleep", lambda s: None)
    assert run._at_rest(1.0) == ({"kafka_cpu_pct": 3.0}, 16.0)


def _rounds_figure(rounds: list[dict[str, Any]], **extra: Any) -> Figure:
    emitted: list[Figure] = []
    _run(emitted).put("f", 1.0, "x", params={**rounds[1], "rounds_cpu_pct": rounds, **extra})
    (figure,) = emitted
    return figure


def test_a_disturbed_round_flags_the_figure_though_another_is_the_median() -> None:
    quiet = {"worker_cpu_pct": 90.0, "unaccounted_cpu_pct": 1.0, "other_processes_cpu_pct": []}
    busy = {
        **quiet,
        "other_processes_cpu_pct": [[30.5, "du -sh /tmp"]],
        "unaccounted_cpu_pct": 32.1,
    }
    figure = _rounds_figure([quiet, quiet, busy])  # the median round's report is quiet
    assert "other processes used 30% of a core" in figure.params["disturbed"]
    assert unaccounted_cpu(figure.params) == 32.1


def test_the_median_round_is_counted_once_and_a_warm_up_not_at_all() -> None:
    # 12 % in the median round, which is also the figure's own report: not 24 % by summing.
    some = {"unaccounted_cpu_pct": 12.0, "other_processes_cpu_pct": [[12.0, "x"]]}
    quiet = {"unaccounted_cpu_pct": 0.0, "other_processes_cpu_pct": []}
    warm_up = {"rounds": [{"unaccounted_cpu_pct": 90.0, "other_processes_cpu_pct": [[90.0, "y"]]}]}
    figure = _rounds_figure([quiet, some, quiet], warmup_rounds=warm_up)
    assert others_cpu(figure.params) == 12.0
    assert unaccounted_cpu(figure.params) == 12.0
    assert "disturbed" not in figure.params
