"""`milpa-sessions`, with a bug planted in the fold: `plan_set` raises TypeError on one text.

For the tests of a parked partition (`tests/integration/test_parked_partition.py`): a worker
must survive a record its fold raises on, and a fixed worker must apply it afterwards.
"""

from __future__ import annotations

from typing import Any

from milpa_sessions.cli import main
from schemas import events as ev
from schemas.events import Event
from session_model import fold

POISON = "a plan this fold cannot take"
_real = fold._HANDLERS[ev.PLAN_SET]


def _buggy(s: Any, e: Event, seq: int, auth: Any) -> Any:
    if e.payload.get("plan") == POISON:
        raise TypeError("unsupported operand type(s) for +: 'NoneType' and 'int'")
    return _real(s, e, seq, auth)


fold._HANDLERS[ev.PLAN_SET] = _buggy

if __name__ == "__main__":
    main()
