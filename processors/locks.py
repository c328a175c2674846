"""Taking an asyncio lock within a time limit."""

from __future__ import annotations

import asyncio


async def acquire_within(lock: asyncio.Lock, timeout: float) -> bool:
    """Take `lock` within `timeout` seconds: whether it was taken.

    A free lock is taken at once, whatever the timeout: `asyncio.wait_for` with a timeout of 0
    refuses even a free one (it cancels the acquiring task before it first runs).
    """
    if not lock.locked():
        await lock.acquire()
        return True
    try:
        await asyncio.wait_for(lock.acquire(), timeout)
    except TimeoutError:
        return False
    return True
