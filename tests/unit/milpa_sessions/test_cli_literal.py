"""Agents write what the CLI shows (goals, todos, questions, calls, ids, codes): it prints them
literally, never as rich markup, and a session it cannot find fails the same way everywhere."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner, Result
from rich.console import Console

import processors.replay
from milpa_sessions import cli, render, stats_cli, wiring
from processors.replay import ReplayReport
from producers.store import SessionStore
from projections.analytics import (
    Count,
    PausesByHour,
    PausesByOutcome,
    PausesByReason,
    TimeToAnswer,
)
from projections.requests import Retention
from schemas.errors import ProjectionError
from session_model.policy import signature_question
from session_model.principal import Principal
from session_model.session import Question
from tests.unit.builders import OPERATOR

# A closing tag with no opening one raises MarkupError; a pair of tags hides its own text;
# `:x:` is an emoji code.
MARKUP = "[/x] [bold]hidden[/bold] :x:"
SID = "s[bold]1[x]"  # (no `/`: `SessionStore.start` refuses it in an id)


class Screen:
    """What the CLI's consoles printed (plain text, no colours, a fixed width)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, width: int) -> None:
        self.buffer = io.StringIO()
        console = Console(file=self.buffer, width=width, force_terminal=False, color_system=None)
        for module, name in ((render, "out"), (cli, "out"), (cli, "err"), (stats_cli, "out")):
            monkeypatch.setattr(module, name, console)

    @property
    def text(self) -> str:
        """Everything printed so far."""
        return self.buffer.getvalue()


@pytest.fixture
def screen(monkeypatch: pytest.MonkeyPatch) -> Screen:
    """The consoles, wide enough that no cell wraps."""
    return Screen(monkeypatch, width=400)


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> SessionStore:
    """The agent's in-memory store; each command gets a store of its own over the same backend."""
    memory = SessionStore.in_memory(signer=OPERATOR, producer=f"agent {MARKUP}", checks=False)
    monkeypatch.setattr(
        cli, "_store", lambda ctx: SessionStore(memory.log, memory.projections, signer=OPERATOR)
    )
    monkeypatch.setattr(wiring, "projection_store", lambda settings: memory.projections)
    return memory


def _run(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args))


def _marked_session(store: SessionStore) -> None:
    store.start(SID, f"goal {MARKUP}")
    store.set_todo(SID, f"t{MARKUP}", f"edit [/etc/hosts] {MARKUP}")
    why = f"why {MARKUP}"
    store.ask(SID, Question("q[/x]", f"question {MARKUP}", ("yes", "no"), why=why, reason="r[/x]"))
    store.answer(SID, "q[/x]", f"yes {MARKUP}", Principal(f"by {MARKUP}"))
    store.answer(SID, "q[/x]", "again", Principal("someone"))  # refused: a rejection row
    store.end(SID, f"because {MARKUP}")


# -- 1. the signing prompt -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    [{"target": "staging[x ,prod]"}, {"target": MARKUP}],
    ids=["a tag hides text", "a closing tag raises"],
)
def test_the_signing_prompt_shows_the_call_as_the_agent_wrote_it(
    store: SessionStore, screen: Screen, arguments: dict[str, Any]
) -> None:
    store.start(SID, "g")
    store.ask(SID, signature_question(f"deploy{MARKUP}", arguments))
    question = store.load(SID).question
    assert question is not None
    result = _run("answer", SID, question.id, "approved", "--yes")
    assert result.exit_code == 0, result.output
    assert f"signing exactly this call in {SID}: deploy{MARKUP} {question.why}\n" in screen.text


def test_the_signing_prompt_is_one_line_the_terminal_wraps(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rich breaking the line at a space would leave the operator unable to tell `a ,b` from `a,b`.
    narrow = Screen(monkeypatch, width=40)
    store.start(SID, "g")
    store.ask(SID, signature_question("deploy", {"target": "staging x ,prod and more words"}))
    question = store.load(SID).question
    assert question is not None
    result = _run("answer", SID, question.id, "approved", "--yes")
    assert result.exit_code == 0, result.output
    assert f"{SID}: deploy {question.why}\n" in narrow.text


def test_a_signature_question_answered_other_than_approved_is_refused_before_the_prompt(
    store: SessionStore, screen: Screen
) -> None:
    store.start(SID, "g")
    store.ask(SID, signature_question("deploy", {"env": "prod"}))
    before = len(store.log.records)  # type: ignore[attr-defined]
    result = _run("answer", SID, "sign:deploy", "no", "--yes")
    assert result.exit_code != 0
    assert "asks for a signature" in result.output + screen.text
    assert "signing exactly" not in screen.text  # nothing offered to sign
    assert len(store.log.records) == before  # type: ignore[attr-defined]


# -- 2. show, list, window, timeline, stats --------------------------------------------------------


def test_show_prints_every_agent_written_field_literally(
    store: SessionStore, screen: Screen
) -> None:
    _marked_session(store)
    result = _run("show", SID)
    assert result.exit_code == 0, result.output
    for written in (
        f"{SID}  ended",
        f"goal: goal {MARKUP}",
        f"ended: because {MARKUP}",
        f"t{MARKUP}",
        f"edit [/etc/hosts] {MARKUP}",
        f"question {MARKUP}",
        f"yes {MARKUP}",
        f"by {MARKUP}",
        "r[/x]",
        f"agent {MARKUP}",
    ):
        assert written in screen.text


def test_list_prints_ids_and_goals_literally(store: SessionStore, screen: Screen) -> None:
    _marked_session(store)
    result = _run("list")
    assert result.exit_code == 0, result.output
    assert SID in screen.text
    assert f"goal {MARKUP}" in screen.text


def test_window_prints_the_turns_literally(store: SessionStore, screen: Screen) -> None:
    store.start(SID, "g")
    store.record_turn(SID, "user", f"hello {MARKUP}")
    result = _run("window", SID)
    assert result.exit_code == 0, result.output
    assert f"user: hello {MARKUP}" in screen.text


def test_timeline_prints_the_sentences_literally(store: SessionStore, screen: Screen) -> None:
    _marked_session(store)
    result = _run("timeline", SID)
    assert result.exit_code == 0, result.output
    assert f"question {MARKUP}" in screen.text


class FakeAnalytics:
    """Analytics rows whose reason codes and counter names an agent chose."""

    def pauses(self, since: Any, now: datetime, by: str) -> list[Any]:
        hour = datetime(2025, 1, 1, 12, tzinfo=UTC)
        rows: dict[str, list[Any]] = {
            "reason": [PausesByReason(f"r{MARKUP}", 1, 1, 0, 0)],
            "hour": [PausesByHour(hour, f"r{MARKUP}", 1)],
            "outcome": [PausesByOutcome("answered", f"r{MARKUP}", 1)],
        }
        return rows[by]

    def time_to_answer(self) -> list[Any]:
        return [TimeToAnswer(f"r{MARKUP}", "le_60", 60, 1)]

    def rejections(self) -> list[Count]:
        return [Count(f"code{MARKUP}", 1)]

    def downgrades(self) -> list[Count]:
        return [Count(f"kind{MARKUP}", 1)]


@pytest.mark.parametrize(
    ("command", "written"),
    [
        (["pauses", "--by", "reason"], f"r{MARKUP}"),
        (["pauses", "--by", "hour"], f"r{MARKUP}"),
        (["pauses", "--by", "outcome"], f"r{MARKUP}"),
        (["tta"], f"r{MARKUP}"),
        (["rejections"], f"code{MARKUP}"),
        (["rejections"], f"kind{MARKUP}"),
    ],
)
def test_stats_print_reason_codes_and_counters_literally(
    monkeypatch: pytest.MonkeyPatch, screen: Screen, command: list[str], written: str
) -> None:
    monkeypatch.setattr(stats_cli, "_analytics", lambda settings: FakeAnalytics())
    result = _run("stats", *command)
    assert result.exit_code == 0, result.output
    assert written in screen.text


def test_a_snapshot_failure_is_printed_literally(
    monkeypatch: pytest.MonkeyPatch, screen: Screen
) -> None:
    # An error's text can quote what an agent wrote (a session id).
    def fail(settings: Any, applied: Any, trust: str) -> int:
        raise ProjectionError(f"cannot snapshot {SID}")

    monkeypatch.setattr(processors.replay, "replay", lambda *a, **k: ReplayReport(1, 1))
    monkeypatch.setattr(wiring, "take_snapshots", fail)
    env = {
        "MILPA_KAFKA_BOOTSTRAP": "127.0.0.1:1",  # nothing is reached: the rebuild is replaced
        "MILPA_REDIS_URL": "redis://127.0.0.1:1/0",
        "MILPA_SNAPSHOT_INTERVAL_S": "60",
    }
    result = CliRunner().invoke(cli.main, ["replay", "--force"], env=env)
    assert result.exit_code == 0, result.output
    assert f"snapshotting it failed: cannot snapshot {SID}" in screen.text


# -- 3. timeline of a session it cannot find -----------------------------------------------------


def test_timeline_of_an_unknown_session_fails_as_show_does(store: SessionStore) -> None:
    shown, timeline = _run("show", "nobody"), _run("timeline", "nobody")
    assert shown.exit_code != 0
    assert (timeline.exit_code, timeline.output) == (shown.exit_code, shown.output)
    assert "no session 'nobody'" in timeline.output


def test_timeline_of_an_expired_session_says_how_to_restore_it(store: SessionStore) -> None:
    store.projections.retention = Retention(1000)  # type: ignore[attr-defined]
    store.start("gone", "g")
    store.end("gone", "done")
    store.projections.expire_due(datetime.now(UTC) + timedelta(days=1))  # type: ignore[attr-defined]
    shown, timeline = _run("show", "gone"), _run("timeline", "gone")
    assert shown.exit_code != 0
    assert (timeline.exit_code, timeline.output) == (shown.exit_code, shown.output)
    assert "milpa-sessions replay --session gone" in timeline.output
