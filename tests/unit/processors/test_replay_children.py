"""A rebuild's forked processes end with their parent, however it ends (kill -9 included): an
orphan folding on would commit into the projection that the next rebuild clears."""

from __future__ import annotations

import os
import signal
import time

import pytest

from processors import replay


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # ended, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc")
@pytest.mark.parametrize("late", [0.0, 0.5])  # 0.5: its parent is killed before it asks
def test_a_rebuild_process_is_killed_with_its_parent(late: float) -> None:
    read, write = os.pipe()
    parent = os.fork()
    if parent == 0:  # the rebuild's parent: it forks one rebuild process, then waits
        me = os.getpid()  # as `_in_processes` passes it (in the child, the parent may be gone)
        child = os.fork()
        if child == 0:
            time.sleep(late)
            replay._die_with(me)
            time.sleep(60)
            os._exit(0)
        os.write(write, str(child).encode())
        time.sleep(60)
        os._exit(0)
    child = int(os.read(read, 32))
    os.kill(parent, signal.SIGKILL)
    os.waitpid(parent, 0)
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = not _gone(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the rebuild process outlived its killed parent"
