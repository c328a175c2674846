"""What `RedisProjectionStore.clear` (a rebuild's first step) deletes under its prefix, on a fake
client: every projection, never the console's sign-outs and sign-in counters nor the lease."""

from __future__ import annotations

import fnmatch
from typing import Any, cast

from projections.keys import Keys
from projections.redis_client import SyncClient
from projections.redis_store import RedisProjectionStore


class _Keyspace:
    """A client holding bare key names: SCAN with a glob, UNLINK."""

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)

    def scan_iter(self, match: str, count: int) -> Any:
        return iter([k.encode() for k in sorted(self.names) if fnmatch.fnmatchcase(k, match)])

    def unlink(self, *names: bytes) -> int:
        gone = {n.decode() for n in names} & self.names
        self.names -= gone
        return len(gone)


def test_clear_deletes_every_generation_and_keeps_the_consoles_keys_and_the_lease() -> None:
    keys = Keys("ms", partitions=2, generations=(2, 0))
    projections = [
        *keys.session("a", 0).every(),
        *keys.session("b", 1).every(),
        *keys.partition_keys(0),
        *keys.retention_keys(1),
        keys.unsnapshotted(0),
        keys.stat("pauses", 1),
        keys.generation_key(0),
        keys.generation_key(1),
        *keys.in_generations((3, 3)).session("a", 0).every(),  # a live rebuild left behind
    ]
    kept = [
        keys.signed_out("leaked-cookie"),
        keys.sign_in_failures("b1"),
        keys.sign_in_failures("src-a1"),
        keys.rebuild_lease(),
        "msx:{w:0}:s:a:state",  # another prefix's
    ]
    client = _Keyspace([*projections, *kept])
    store = RedisProjectionStore(cast(SyncClient, client), keys, follow=False)
    store.clear()
    assert client.names == set(kept)
    assert store.keys.generations == ()  # the rebuild starts over in generation 0
