"""The `milpa-sessions` CLI against the real stack: tables, JSON, steering, one-line errors."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from deploy.harness import wait_for
from milpa_sessions.cli import main
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from producers.store import SessionStore
from producers.topics import group_members
from projections.redis_store import RedisProjectionStore
from session_model.policy import permission_question
from session_model.projection import Position
from session_model.signing import TrustedKeys
from tests.integration.conftest import run_cli, with_keys
from tests.integration.expected import expected_projections
from tests.integration.test_scale_and_crash import assert_equals_the_fold, generate, send_all

pytestmark = pytest.mark.integration


def _run(settings: Settings, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env={**settings.to_env(), **(env or {})})
    return result.exit_code, result.output


def _mark(projections: RedisProjectionStore, sid: str) -> Position | None:
    raw = projections.client.hget(projections.keys.session(sid).state, "mark")
    return Position.parse(raw.decode()) if raw else None


def test_cli_reads_and_steers_a_session_end_to_end(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: object,
    tmp_path: Path,
) -> None:
    code, out = _run(settings, "keys", "generate", "ops-1", "--dir", str(tmp_path))
    assert code == 0, out
    start_worker(with_keys(settings, trusted_keys_dir=tmp_path / "trusted"))  # type: ignore[operator]
    operator = {"MILPA_SIGNING_KEY": str(tmp_path / "ops-1.key")}
    agent = SessionStore(kafka_log, projections, producer="agent-1", read_timeout=60)
    agent.start("cli-1", "refactor the billing module")
    agent.record_turn("cli-1", "user", "begin with the invoices")
    agent.set_todo("cli-1", "t1", "split Invoice", "in_progress")
    agent.ask("cli-1", permission_question("deploy", {"env": "staging"}))
    agent.load("cli-1")

    code, listing = _run(settings, "list")
    assert code == 0 and "cli-1" in listing and "waiting" in listing
    code, raw = _run(settings, "--json", "show", "cli-1")
    shown = json.loads(raw)
    assert code == 0
    assert (shown["status"], shown["question"], shown["open_todos"]) == (
        "waiting",
        "perm:deploy",
        1,
    )
    code, window = _run(settings, "window", "cli-1")
    assert code == 0 and "begin with the invoices" in window and "[~] t1: split Invoice" in window

    code, out = _run(settings, "answer", "cli-1", "perm:deploy", "yes", "--by", "cli:rod@laptop")
    assert code == 0, out
    code, out = _run(settings, "grant", "cli-1", "deploy")  # no operator key: refused up front
    assert code == 2
    assert "only an operator's signature" in out.strip().splitlines()[-1]
    code, out = _run(settings, "grant", "cli-1", "deploy", env=operator)
    assert code == 0, out
    code, out = _run(settings, "mode", "cli-1", "acknowledge", env=operator)
    assert code == 0, out
    before = _mark(projections, "cli-1")
    code, out = _run(settings, "end", "cli-1", "finished by the operator")
    assert code == 0, out
    wait_for(lambda: (s := projections.load("cli-1")) is not None and s.ended, timeout=60)
    assert _mark(projections, "cli-1") != before

    session = projections.load("cli-1")
    assert session is not None
    assert session.permissions == ("deploy",)
    assert session.mode.value == "acknowledge"
    assert session.decisions[0].by is not None
    assert (session.decisions[0].by.id, session.decisions[0].by.verified) == (
        "cli:rod@laptop",
        False,
    )
    assert session.ended_because == "finished by the operator"

    code, raw = _run(settings, "--json", "timeline", "cli-1", "--since", "3")
    kinds = [e["kind"] for e in json.loads(raw)]
    assert code == 0
    assert kinds == ["waiting", "answered", "open-work", "ended"]


def test_cli_bad_input_exits_non_zero_with_one_line(
    settings: Settings, start_worker: object
) -> None:
    code, out = _run(settings, "show", "no-such-session")
    assert code != 0
    assert out.strip().splitlines() == ["error: no session 'no-such-session'"]
    code, out = _run(settings, "answer", "x", "q", "yes", "--verified")
    assert code == 2
    assert out.strip().splitlines()[-1].startswith("error: --verified needs MILPA_SIGNING_KEY")


def test_cli_signs_verified_answers_with_the_configured_key(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: object,
    tmp_path: Path,
) -> None:
    code, out = _run(settings, "keys", "generate", "ops-1", "--dir", str(tmp_path))
    assert code == 0, out
    trusted = tmp_path / "trusted"
    start_worker(with_keys(settings, trusted_keys_dir=trusted))  # type: ignore[operator]
    agent = SessionStore(kafka_log, projections, producer="agent-1", read_timeout=60)
    agent.start("cli-signed", "needs a real approval")
    agent.ask("cli-signed", permission_question("deploy", {"env": "prod"}))
    agent.load("cli-signed")
    env = {"MILPA_SIGNING_KEY": str(tmp_path / "ops-1.key")}
    args = ["answer", "cli-signed", "perm:deploy", "yes", "--by", "actor:member:42", "--verified"]
    code, out = _run(settings, *args, env=env)
    assert code == 0, out
    wait_for(lambda: bool((s := projections.load("cli-signed")) and s.decisions), timeout=60)
    session = projections.load("cli-signed")
    assert session is not None
    assert session.decisions[0].by is not None and session.decisions[0].by.verified is True
    assert session.downgrades == 0


def test_replay_is_refused_while_workers_run_and_rebuilds_once_they_stopped(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: object,
) -> None:
    worker = start_worker()  # type: ignore[operator]
    agent = SessionStore(kafka_log, projections, producer="agent-1", read_timeout=60)
    agent.start("rp-1", "keep the projection")
    agent.record_turn("rp-1", "user", "hello")
    before = agent.load("rp-1")
    wait_for(lambda: group_members(settings))

    code, output = _run(settings, "replay")

    assert code == 1
    assert "WorkersRunningError" in output and "stop them before a replay" in output
    assert settings.consumer_group in output
    assert agent.load("rp-1") == before  # nothing was dropped
    worker.stop()  # type: ignore[attr-defined]
    wait_for(lambda: not group_members(settings))
    code, output = _run(settings, "replay")
    assert code == 0 and "replayed 2 records into 1 sessions" in output
    assert agent.load("rp-1") == before


def test_the_replay_command_forks_one_rebuild_process_per_cpu_or_as_many_as_given(
    settings: Settings, kafka_log: KafkaEventLog, projections: RedisProjectionStore
) -> None:
    """As an operator runs it (a process of its own, its progress bar drawn): pytest's own
    threads keep an in-process call to one process, so this runs the command."""
    sids, events = generate(60, prefix="fork", group=20)
    last = send_all(kafka_log, events)
    partitions = {p.partition for p in last.values()}
    assert len(partitions) > 1

    expected = expected_projections(events, TrustedKeys.none())
    # A partition without records needs no process. Two forks on any machine; one forks none.
    for given, processes in (
        ((), min(len(os.sched_getaffinity(0)), len(partitions))),
        (("--processes", "2"), 2),
        (("--processes", "1"), 1),
    ):
        done = run_cli(settings, "replay", "--force", "--full", *given)

        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(done.stdout)
        assert (report["records"], report["sessions"]) == (len(events), len(sids))
        assert report["processes"] == processes, given
        assert_equals_the_fold(projections, expected)


def test_replay_without_its_snapshots_topic_stands_and_says_the_topic_is_missing(
    settings: Settings, kafka_log: KafkaEventLog, projections: RedisProjectionStore
) -> None:
    sids, events = generate(6, prefix="nosnap", group=6)
    send_all(kafka_log, events)
    missing = replace(settings, snapshots_topic=f"{settings.snapshots_topic}-never-created")

    done = run_cli(missing, "replay", "--force", "--full")

    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert (report["records"], report["sessions"]) == (len(events), len(sids))
    assert report["snapshots_taken"] == 0
    # Said at once, before any snapshot writer waits for a topic that is not there.
    assert report["snapshot_error"] == f"topic {missing.snapshots_topic} does not exist"
    assert sorted(projections.ids()) == sids


def test_a_worker_refuses_a_half_built_projection_until_a_replay_ends(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    worker = start_worker()
    agent = SessionStore(kafka_log, projections, producer="agent-1", read_timeout=60)
    agent.start("hb-1", "outlive a rebuild that died")
    agent.record_turn("hb-1", "user", "hello")
    before = agent.load("hb-1")
    worker.stop()
    # What a plain replay that died after its clear leaves (the store's calls the rebuild makes).
    projections.begin_rebuild("replay", datetime.now(UTC))
    projections.clear()
    try:
        refused = run_cli(settings, "worker")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        said = " ".join(refused.stderr.split())
        assert "RebuildIncompleteError" in said and "did not finish" in said, said
        assert "run `milpa-sessions replay` again" in said

        done = run_cli(settings, "replay", "--force")  # the remedy: it runs over the mark
        assert done.returncode == 0, done.stdout + done.stderr
        assert projections.incomplete_rebuild() is None
        assert agent.load("hb-1") == before
        start_worker()
        at = agent.record_turn("hb-1", "assistant", "after the rebuild")
        session = projections.load("hb-1", at_least=at, timeout=60)
        assert session is not None and session.seq == before.seq + 1
    finally:  # the fixture's clear leaves the mark (as a rebuild's does)
        projections.end_rebuild()
