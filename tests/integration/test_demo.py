"""The README's main job, `milpa-sessions demo`, on the real stack and in memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deploy.harness import REPO
from milpa_sessions.settings import Settings

pytestmark = pytest.mark.integration


def _demo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "milpa_sessions.cli", "demo", "--agents", "3", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **env},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.mark.parametrize("backend", ["kafka-and-redis", "in-memory"])
def test_the_demo_runs_a_fleet_whose_authority_is_all_signed(
    settings: Settings, backend: str
) -> None:
    done = _demo(settings.to_env(), *(["--in-memory"] if backend == "in-memory" else []))
    out = done.stdout
    assert done.returncode == 0, (out + done.stderr)[-3000:]
    assert "signed by the operator" in out
    assert "unsigned authority refused: 0" in out
    assert "call approvals" in out
    if backend == "kafka-and-redis":
        assert "decisions received" in out
        assert "operator console: http://127.0.0.1:" in out
        assert "sign in as demo, password " in out
