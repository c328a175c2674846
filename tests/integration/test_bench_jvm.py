"""The broker's JIT and collector seconds (`deploy.host.jvm_times`) read off a real JVM of this
machine's Java, against what the JDK's own `jstat` reads of it.

Plain stack only: it needs no server, and one run of it is enough.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.host import jvm_times

pytestmark = [pytest.mark.integration, pytest.mark.plain_stack]

# Work enough for the JIT to compile something and the collector to run (400 MiB of garbage in a
# 64-MiB heap), then idle (nothing compiles or collects while it sleeps).
PROGRAM = """
public class Spin {
    public static void main(String[] args) throws Exception {
        long sum = 0;
        for (int round = 0; round < 200; round++) {
            StringBuilder text = new StringBuilder();
            for (int i = 0; i < 20_000; i++) { text.append(i % 10); sum += text.length(); }
        }
        for (int i = 0; i < 400; i++) { byte[] junk = new byte[1 << 20]; sum += junk.length; }
        System.out.println("ready " + sum);
        System.out.flush();
        Thread.sleep(120_000);
    }
}
"""


@pytest.fixture
def jvm(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    java = shutil.which("java")
    if java is None:
        pytest.fail("java not found: the local stack's broker runs on this machine's Java")
    source = tmp_path / "Spin.java"
    source.write_text(PROGRAM)
    argv = [java, "-Xmx64m", "-XX:+UseG1GC", str(source)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the single-file launcher compiles it first: a second or so
        assert line.startswith("ready"), line
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _jstat(pid: int, option: str, column: str) -> float:
    jstat = shutil.which("jstat")
    if jstat is None:
        pytest.fail("jstat not found beside java (a JDK, not a JRE, runs the stack's broker)")
    out = subprocess.run([jstat, option, str(pid)], capture_output=True, text=True, check=True)
    header, values = (line.split() for line in out.stdout.strip().splitlines()[:2])
    return float(values[header.index(column)])


def test_a_real_jvms_compile_and_collector_seconds_are_what_jstat_reads(
    jvm: subprocess.Popen[str],
) -> None:
    deadline = time.monotonic() + 10
    before = jvm_times(jvm.pid)
    while before is None and time.monotonic() < deadline:
        time.sleep(0.05)
        before = jvm_times(jvm.pid)
    assert before is not None, "no performance counters found for a running JVM"
    compiled = _jstat(jvm.pid, "-compiler", "Time")
    collected = _jstat(jvm.pid, "-gcutil", "GCT")
    after = jvm_times(jvm.pid)
    assert after is not None
    # It compiled its loops and the launcher's compiler, and collected; jstat (2 and 3
    # decimals) read in between.
    assert before.compile_s > 0.05 and before.gc_s > 0
    assert round(before.compile_s, 2) - 0.01 <= compiled <= round(after.compile_s, 2) + 0.01
    assert round(before.gc_s, 3) - 0.001 <= collected <= round(after.gc_s, 3) + 0.001
