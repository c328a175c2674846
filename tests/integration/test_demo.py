"""The README's main job, `milpa-sessions demo`, on the real stack and in memory."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from deploy.harness import REPO
from milpa_sessions.settings import Settings

pytestmark = pytest.mark.integration


def _demo(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "milpa_sessions.cli", "demo", "--agents", "3", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **env},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


# The demo composes the worker, the console, the CLI's signing and a decisions subscriber; each of
# them runs on the secured stack in the tests that check it (test_secure_stack's end-to-end path
# with one principal per role, test_console_browser, test_cli): the demo itself is run once, in the
# plain pass.
@pytest.mark.fault_load
@pytest.mark.parametrize("backend", ["kafka-and-redis", "in-memory"])
def test_the_demo_runs_a_fleet_whose_authority_is_all_signed(
    settings: Settings, backend: str, tmp_path: Path
) -> None:
    in_memory = ["--in-memory"] if backend == "in-memory" else []
    done = _demo(settings.to_env(), tmp_path, *in_memory)
    out = done.stdout
    assert done.returncode == 0, (out + done.stderr)[-3000:]
    assert "signed by the operator" in out
    assert "unsigned authority refused: 0" in out
    assert "call approvals" in out
    # Written to a pipe, the live table ends its line: the next section starts a line of its own.
    assert re.search(r"^─+ sessions \(demo-", out, re.M), out[:3000]
    if backend == "kafka-and-redis":
        assert "decisions received" in out
        assert "operator console: http://127.0.0.1:" in out
        assert "sign in as demo, password " in out
    # Its worker ran in the demo's own temporary directory: nothing is left where it started.
    assert list(tmp_path.iterdir()) == []


@pytest.mark.fault_load  # as above
def test_the_console_demo_keeps_the_fleet_waiting_for_a_person(
    settings: Settings, tmp_path: Path
) -> None:
    """`demo --console`: the console's URL and a demo operator's credentials are printed; the
    fleet's questions wait in the inbox until someone answers one over HTTP; Ctrl-C ends it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "milpa_sessions.cli", "demo", "--agents", "2", "--console"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **settings.to_env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()], daemon=True)
    reader.start()
    printed = ""
    try:
        deadline = time.monotonic() + 120
        while "password" not in printed and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                printed += lines.get(timeout=1)
        url = re.search(r"operator console: (http://\S+)", printed)
        password = re.search(r"sign in as demo, password (\S+)", printed)
        assert url and password, printed[-3000:]
        with httpx.Client(base_url=url.group(1), timeout=30) as client:
            form = client.get("/login").text
            login_csrf = re.search(r'name="csrf" value="([^"]+)"', form)
            assert login_csrf
            client.post(
                "/login",
                data={"username": "demo", "password": password.group(1), "csrf": login_csrf[1]},
            )
            csrf = re.search(r'name="csrf-token" content="([^"]+)"', client.get("/inbox").text)
            assert csrf, "not signed in"
            found: list[dict[str, object]] = []
            deadline = time.monotonic() + 120
            while not found and time.monotonic() < deadline:
                found = client.get("/api/v1/questions").json()["items"]
                time.sleep(0.5)
            assert found, "the fleet asked nothing"
            q = found[0]
            sid = str(q["session_id"])
            signature = q["reason"] == "signature"
            body = {
                "question_id": q["question_id"],
                "answer": "approved" if signature else q["options"][0],  # type: ignore[index]
                "confirm": str(q["question_id"]).removeprefix("sign:") if signature else None,
                "asked_seq": q["seq"],
            }
            done = client.post(
                f"/api/v1/sessions/{sid}/answer", json=body, headers={"X-CSRF-Token": csrf[1]}
            )
            assert done.status_code == 202, done.text
            decided = False
            deadline = time.monotonic() + 60
            while not decided and time.monotonic() < deadline:
                decisions = client.get(f"/api/v1/sessions/{sid}").json()["decisions"]
                decided = any(d["by"] == "operator:demo" and d["verified"] for d in decisions)
                time.sleep(0.3)
            assert decided, "the answer did not become a decision of operator:demo"
        assert proc.poll() is None, "the fleet stopped on its own"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            # The demo stops its worker and console together, each within a 30 s grace.
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()  # reaped here, not reported as a leak by whichever test runs next
            reader.join(10)
            while not lines.empty():
                printed += lines.get()
            tail = printed[-3000:]
            raise AssertionError(f"Ctrl-C did not stop the demo in 90 s:\n{tail}") from None
        finally:
            reader.join(10)  # it ends at the end of the output
            if proc.stdout is not None:
                proc.stdout.close()
