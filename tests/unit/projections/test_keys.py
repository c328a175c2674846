"""Where keys live: a partition is one hash slot, and the partitions spread over the slot range."""

from __future__ import annotations

import fnmatch
from datetime import UTC, datetime, timedelta

import pytest
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from projections.keys import Keys, partition_tag
from projections.requests import (
    Restored,
    commit,
    commit_call,
    drop_command,
    key_of,
    read,
    restore_call,
    unmark_command,
)
from schemas import events as ev
from schemas.events import Event
from session_model.partitioning import partition_for
from session_model.projection import BatchFolder, Folded, Position, Record

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _slots(keys: list[str]) -> set[int]:
    return {key_slot(k.encode()) for k in keys}


@pytest.mark.parametrize("partitions", [1, 3, 6, 12, 24, 64])
def test_partitions_spread_evenly_over_the_slot_range(partitions: int) -> None:
    """`redis-cli --cluster create` gives masters even slot ranges: each gets its share."""
    keys = Keys("ms", partitions=partitions)
    slots = [key_slot(keys.tag(p)[len("ms:") :].strip("{}").encode()) for p in range(partitions)]
    for p, slot in enumerate(slots):
        assert p * REDIS_CLUSTER_HASH_SLOTS // partitions <= slot
        assert slot < (p + 1) * REDIS_CLUSTER_HASH_SLOTS // partitions
    for masters in (3, 5):
        if partitions >= masters:
            owners = [slot * masters // REDIS_CLUSTER_HASH_SLOTS for slot in slots]
            counts = [owners.count(m) for m in range(masters)]
            assert max(counts) - min(counts) <= 1, counts


def test_a_partition_tag_is_stable_and_refuses_partitions_outside_the_topic() -> None:
    assert partition_tag(0, 6) == partition_tag(0, 6)
    assert partition_tag(0, 6).startswith("w:0")
    with pytest.raises(ValueError, match="partition 6"):
        partition_tag(6, 6)
    with pytest.raises(ValueError, match="partitions"):
        Keys("ms", partitions=0)


def test_every_key_of_a_partition_is_in_its_slot() -> None:
    keys = Keys("ms", partitions=6)
    for p in range(6):
        sid = next(f"s{i}" for i in range(1000) if partition_for(f"s{i}", 6) == p)
        every = [
            *keys.session(sid).every(),
            *keys.partition_keys(p),
            *keys.retention_keys(p),
            keys.unsnapshotted(p),
            keys.waiting_reason(p, "permission"),
            keys.stat("pauses", p),
            keys.stat_hour("pauses", "2026010100", p),
        ]
        assert len(_slots(every)) == 1, p
        assert keys.session(sid) == keys.session(sid, p)


def test_a_state_key_names_its_session_back_and_others_do_not() -> None:
    keys = Keys("ms", partitions=6)
    for sid in ("a", "with:colons", "with}brace", "x:state"):
        assert keys.session_of(keys.session(sid).state) == sid
    assert keys.session_of(keys.waiting(0)) is None
    assert keys.session_of(keys.session("a").turns) is None
    assert keys.session_of("other:{w:0}:s:a:state") is None


def test_a_counter_field_names_the_same_counter_in_every_partition() -> None:
    keys = Keys("ms", partitions=6)
    field = keys.counter_field(keys.stat_hour("pauses", "2026010100", 2), "permission")
    assert field == "pauses:h:2026010100\tpermission"
    for p in range(6):
        assert keys.counter_of(field, p) == (
            keys.stat_hour("pauses", "2026010100", p),
            "permission",
        )


def _records(sid: str, partition: int) -> list[Record]:
    payloads = [
        (ev.STARTED, {"goal": "g", "mode": "ask"}),
        (ev.QUESTION_ASKED, {"question_id": "q", "question": "ok?", "reason": "permission"}),
    ]
    return [
        Record(
            Event(f"{sid}-{n}", sid, t, T0 + timedelta(seconds=n), "test", payload),
            Position(partition, n),
        )
        for n, (t, payload) in enumerate(payloads)
    ]


def test_every_script_call_touches_one_slot_and_groups_never_mix_partitions() -> None:
    """What Redis Cluster requires of a script call: its KEYS in one slot."""
    keys = Keys("ms", partitions=6)
    sids = [f"sess-{i}" for i in range(300)]
    records = [r for sid in sids for r in _records(sid, partition_for(sid, 6))]
    updates = BatchFolder().fold({}, records)
    calls = [commit_call(keys, u, 40, track=True) for u in updates]
    request = commit(keys, sids, calls, [u.mark.partition for u in updates])
    assert len(request.commands) >= 6
    for command in request.commands:
        assert command[0] == "EVALSHA"
        assert len(_slots(list(command[3 : 3 + command[2]]))) == 1
    for command in read(keys, sids).commands:
        assert len(_slots(list(command[3 : 3 + command[2]]))) == 1
    for sid in sids[:12]:
        p = partition_for(sid, 6)
        drop = drop_command(keys, sid, p)
        assert len(_slots(list(drop[3 : 3 + drop[2]]))) == 1
        assert key_of(drop) == keys.session(sid).state
        unmark = unmark_command(keys, sid, p, "2026-01-01T00:00:00+00:00 5eed")
        assert key_of(unmark) == keys.restoring(p)  # where Redis Cluster sends it
        assert len(_slots([keys.restoring(p), keys.session(sid).state])) == 1
    folded = Folded(updates[0].state, updates[0].mark)
    counters = {keys.counter_field(keys.stat("pauses", 0), "permission"): 1}
    restored_keys, _ = restore_call(keys, Restored(folded, (), counters), 40)
    assert len(_slots(restored_keys)) == 1


def test_a_commit_reports_each_session_under_its_own_id_whatever_the_grouping() -> None:
    keys = Keys("ms", partitions=6)
    sids = [f"sess-{i}" for i in range(20)]
    updates = BatchFolder().fold(
        {}, [r for sid in sids for r in _records(sid, partition_for(sid, 6))]
    )
    calls = [commit_call(keys, u, 40) for u in updates]
    request = commit(keys, sids, calls, [u.mark.partition for u in updates])
    # Each group starts with its partition's generation hash and generation.
    for command in request.commands:
        assert command[3].startswith("ms:generation:{w:")
        assert command[3 + command[2]] == 0
    # The script answers per group, in the order the groups' sessions were sent.
    replies = []
    for command in request.commands:
        n = sum(1 for k in command[3 : 3 + command[2]] if k.endswith(":state"))
        replies.append([1] * n)
    replies[0][0] = 0  # the first session of the first group conflicted
    first = next(sid for sid in sids if keys.session(sid).state == request.commands[0][4])
    result = request.parse(replies).result
    assert result.conflicts == (first,)
    assert sorted(result.applied) == sorted(set(sids) - {first})


def test_a_partition_in_a_newer_generation_refuses_the_group_and_says_so() -> None:
    keys = Keys("ms", partitions=6)
    sids = [f"sess-{i}" for i in range(12)]
    updates = BatchFolder().fold(
        {}, [r for sid in sids for r in _records(sid, partition_for(sid, 6))]
    )
    request = commit(
        keys, sids, [commit_call(keys, u, 40) for u in updates], [u.mark.partition for u in updates]
    )
    replies = [
        [3 if i == 0 else 1] * sum(1 for k in c[3 : 3 + c[2]] if k.endswith(":state"))
        for i, c in enumerate(request.commands)
    ]
    done = request.parse(replies)
    assert done.stale_generation
    assert len(done.result.conflicts) == len(replies[0])
    assert not request.parse([[1] * len(r) for r in replies]).stale_generation


def test_generation_keys_live_beside_their_partition_and_never_match_a_generations_pattern() -> (
    None
):
    keys = Keys("ms", partitions=6, generations=(0, 2, 2, 0, 0, 1))
    assert keys.tag(0) == "ms:" + keys.tag(0)[3:] and not keys.tag(0).startswith("ms:g")
    assert keys.tag(1).startswith("ms:g2:{w:1")
    for p in range(6):
        assert len(_slots([keys.generation_key(p), keys.session(f"x{p}", p).state])) == 1
    for g in (0, 1, 2):
        pattern = keys.generation_pattern(g).replace("\\", "")
        assert not fnmatch.fnmatchcase(keys.generation_key(1), pattern)
    assert fnmatch.fnmatchcase(keys.session("a", 1).state, keys.generation_pattern(2))
    assert not fnmatch.fnmatchcase(keys.session("a", 0).state, keys.generation_pattern(2))
    assert keys.session_of(keys.session("a", 1).state) == "a"
    assert keys.in_use() == (0, 1, 2)


def test_a_rebuild_clears_every_projection_key_and_nothing_else_under_the_prefix() -> None:
    """`Keys.rebuilds`: every generation's keys and the generation hashes, never the console's
    sign-outs and sign-in counters (a signed-out cookie would be accepted again), the lease, nor
    the mark of a rebuild under way (the clear would erase the warning it exists for)."""
    keys = Keys("ms", partitions=6, generations=(0, 2, 2, 0, 0, 1))
    projections = [keys.generation_key(p) for p in range(6)]
    for p in range(6):
        sid = next(f"s{i}" for i in range(1000) if partition_for(f"s{i}", 6) == p)
        projections += [
            *keys.session(sid, p).every(),
            *keys.partition_keys(p),
            *keys.retention_keys(p),
            keys.unsnapshotted(p),
            keys.waiting_reason(p, "permission"),
            keys.stat("pauses", p),
            keys.stat_hour("pauses", "2026010100", p),
        ]
    assert {k[: len("ms:g2:")] for k in projections} >= {"ms:{w:", "ms:g1:", "ms:g2:", "ms:gen"}
    assert all(keys.rebuilds(k) for k in projections)
    kept = [
        keys.signed_out("c0ffee"),
        keys.signed_out("{w:0}"),
        keys.sign_in_failures("b1"),
        keys.sign_in_failures("src-a1"),
        keys.rebuild_lease(),
        keys.rebuild_incomplete(),
        "other:{w:0}:s:a:state",  # another prefix's
        "ms:x:{w:0}:s:a:state",  # a prefix under this one: `ms:x`'s
        "msx:{w:0}:s:a:state",
    ]
    assert not any(keys.rebuilds(k) for k in kept)


def test_the_drop_names_every_index_of_its_partition_that_holds_session_ids() -> None:
    """lua/drop.lua takes the session out of each (the deadlines too: the scheduler would read
    an expired session at every poll)."""
    keys = Keys("ms", partitions=6)
    for now_ms in (None, 1_000):
        drop = drop_command(keys, "s1", 4, now_ms)
        named = set(drop[3 : 3 + drop[2]])
        assert named >= {
            *keys.partition_keys(4),
            *keys.retention_keys(4),
            keys.unsnapshotted(4),
        }
