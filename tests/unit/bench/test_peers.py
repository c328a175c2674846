"""The peers' shared helpers: the worker's fold, the state's encoding, the report, the stamps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import infra, workload
from bench.figures.peers import _per_cpu_s
from bench.peers.common import (
    DIR_ENV,
    EXPECT_ENV,
    STAMPS_ENV,
    PeerFold,
    Reporter,
    decode_state,
    encode_state,
    latencies,
    parse_stamps,
)
from milpa_sessions.settings import Settings
from schemas import events as ev
from schemas.codec import EventCodec
from session_model.authority import Authority
from session_model.fold import fold
from session_model.intake import KEY_MISMATCH, Refusal
from session_model.partitioning import partition_for
from session_model.projection import Record
from session_model.session import Session


def _peer(tmp_path: Path) -> PeerFold:
    keys = infra.trusted_keys_dir(tmp_path, workload.OPERATOR)
    return PeerFold.of(Settings(trusted_keys_dir=keys))


def test_the_peer_folds_as_the_fold_does_with_the_operators_keys(tmp_path: Path) -> None:
    peer = _peer(tmp_path)
    work = workload.sessions_workload(12, "peer", concurrency=4, partitions=6)
    codec = EventCodec()
    states: dict[str, Session] = {}
    for offset, e in enumerate(work.events):
        record = peer.admit(
            e.session_id.encode(), codec.encode(e), partition_for(e.session_id, 6), offset
        )
        assert isinstance(record, Record)
        prior = states.get(e.session_id)
        states[e.session_id] = peer.step(
            None if prior is None else decode_state(encode_state(prior)), record
        ).state
    auth = Authority(workload.OPERATOR_KEYS)
    for sid in work.sessions:
        mine = [e for e in work.events if e.session_id == sid]
        assert states[sid] == fold(sid, mine, auth)
    # The operator's signed grants and relaxed modes were believed: the trusted keys are wired.
    signed = {ev.PERMISSION_GRANTED, ev.MODE_CHANGED}
    assert not [r for s in states.values() for r in s.rejections if r.type in signed]
    assert any(s.permissions or s.mode != "ask" for s in states.values())


def test_the_peer_refuses_what_the_worker_refuses(tmp_path: Path) -> None:
    e = workload.starts(["s1"])[0]
    refused = _peer(tmp_path).admit(b"other", EventCodec().encode(e), partition_for("s1", 6), 0)
    assert isinstance(refused, Refusal)
    assert refused.code == KEY_MISMATCH


def test_the_report_stamps_every_record_and_says_when_it_is_done(tmp_path: Path) -> None:
    environ = {DIR_ENV: str(tmp_path / "r"), EXPECT_ENV: "2", STAMPS_ENV: "1"}
    report = Reporter.from_env(environ)
    report.folded(0, 7, "applied")
    assert json.loads((tmp_path / "r" / "first.json").read_text())["t"] > 0
    assert not (tmp_path / "r" / "done.json").exists()
    report.folded(3, 1, "undecodable")
    done = json.loads((tmp_path / "r" / "done.json").read_text())
    assert done["records"] == 2
    assert done["kinds"] == {"applied": 1, "undecodable": 1}
    assert done["t_done"] >= done["t_first"]
    stamped, rest = parse_stamps((tmp_path / "r" / "stamps").read_text())
    assert set(stamped) == {(0, 7), (3, 1)}
    assert rest == ""
    report.close()


def test_stamps_are_parsed_up_to_the_unfinished_line() -> None:
    stamped, rest = parse_stamps("0 5 1.5\n2 9 2.25\n1 3 4.")
    assert stamped == {(0, 5): 1.5, (2, 9): 2.25}
    assert rest == "1 3 4."
    more, rest = parse_stamps(rest + "75\n")
    assert more == {(1, 3): 4.75}
    assert rest == ""


def test_latencies_match_sends_by_partition_and_offset() -> None:
    sends = [(0, 5, 1.0, 1.002), (1, 5, 1.001, 1.003), (0, 6, 1.5, 1.51)]
    lat = latencies(sends, {(0, 5): 1.010, (1, 5): 1.021})
    assert lat.unresolved == 1
    assert lat.sent_at == [1.0, 1.001]
    assert lat.from_send == pytest.approx([10.0, 20.0])
    assert lat.from_ack == pytest.approx([8.0, 18.0])


def test_events_per_cpu_second_is_the_rate_over_the_share_of_a_core() -> None:
    assert _per_cpu_s(1000.0, 50.0) == pytest.approx(2000.0)
    assert _per_cpu_s(None, 50.0) is None
    assert _per_cpu_s(1000.0, 0.0) is None
