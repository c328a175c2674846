"""The README's API example runs and says what it claims."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_api_example_runs_and_records_a_verified_decision() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    session: Any = namespace["session"]
    assert session.is_runnable()
    by = session.decisions[0].by
    assert (by.id, by.verified) == ("actor:member:42", True)
    assert [m.role for m in session.window()] == ["system", "user", "tool", "user"]
