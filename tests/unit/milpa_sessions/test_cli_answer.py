"""`milpa-sessions answer` signs the asking it showed, or nothing."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from milpa_sessions import cli
from producers.kafka_log import KafkaEventLog
from producers.store import SessionStore
from session_model.policy import signature_question
from session_model.principal import Principal
from session_model.session import Question
from tests.unit.builders import OPERATOR


def test_an_asking_replaced_between_the_read_and_the_answer_is_not_signed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = SessionStore.in_memory(signer=OPERATOR)
    store.start("s1", "g")
    store.ask("s1", Question("sign:drop_db", "Proceed?", ("ok", "no")))  # a plain question
    shown = store.load("s1")  # what the CLI reads (no signature prompt for a plain question)
    # Meanwhile the agent answers it itself and asks the same id as a signature question.
    store.answer("s1", "sign:drop_db", "no", Principal("agent"))
    store.ask("s1", signature_question("drop_db", {"db": "prod"}))
    before = len(store.log.records)  # type: ignore[attr-defined]
    real = store.load
    reads: list[str] = []

    def load(sid: str, at_least: Any = None) -> Any:
        reads.append(sid)
        return shown if len(reads) == 1 else real(sid, at_least)

    monkeypatch.setattr(store, "load", load)
    monkeypatch.setattr(cli, "_store", lambda ctx: store)
    result = CliRunner().invoke(cli.main, ["answer", "s1", "sign:drop_db", "approved", "--yes"])
    assert result.exit_code != 0
    assert "asked again" in result.output
    assert len(store.log.records) == before  # type: ignore[attr-defined]


def test_a_commands_producer_and_redis_client_are_closed_when_the_command_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Even one that failed: a command run where the process goes on (CliRunner, an embedding
    tool) must not leave its broker or Redis connections to the garbage collector."""
    closed: list[object] = []

    class Log(KafkaEventLog):
        def close(self, timeout: float | None = 10.0) -> None:
            closed.append(timeout)

    memory = SessionStore.in_memory(signer=OPERATOR)
    store = SessionStore(Log("127.0.0.1:9", "t.events"), memory.projections, signer=OPERATOR)
    monkeypatch.setattr(memory.projections, "close", lambda: closed.append("projections"))
    monkeypatch.setattr(cli.wiring, "session_store", lambda settings, producer: store)
    result = CliRunner().invoke(cli.main, ["answer", "nope", "q1", "yes"])
    assert result.exit_code == 2 and "no session 'nope'" in result.output
    assert closed == [5.0, "projections"]


@pytest.mark.parametrize("live", [False, True])
def test_a_rebuilds_redis_client_is_closed_when_the_command_ends(
    monkeypatch: pytest.MonkeyPatch, live: bool
) -> None:
    """`replay` and `replay --live` close the projection store they rebuilt."""
    import processors.generations  # noqa: PLC0415
    import processors.replay  # noqa: PLC0415
    import producers.topics  # noqa: PLC0415

    closed: list[str] = []

    class Store:
        def close(self) -> None:
            closed.append("projections")

    limits: list[int] = []

    def rebuilt(*args: Any, **kwargs: Any) -> Any:
        assert not closed, "closed before the rebuild ended"
        limits.append(kwargs["cache_limit"])
        raise RuntimeError("the rebuild failed")

    monkeypatch.setattr(cli.wiring, "projection_store_for_rebuild", lambda settings: Store())
    monkeypatch.setattr(processors.replay, "replay", rebuilt)
    monkeypatch.setattr(processors.generations, "rebuild_live", rebuilt)
    monkeypatch.setattr(producers.topics, "group_members", lambda settings: [])
    env = {"MILPA_REBUILD_CACHE_SESSIONS": "1234"}
    result = CliRunner().invoke(cli.main, ["replay", *(["--live"] if live else [])], env=env)
    assert isinstance(result.exception, RuntimeError), result.output
    assert closed == ["projections"]
    assert limits == [1234]  # each rebuild process keeps what the setting says

    env = {"MILPA_REBUILD_CACHE_SESSIONS": "0"}
    result = CliRunner().invoke(cli.main, ["replay", *(["--live"] if live else [])], env=env)
    assert "MILPA_REBUILD_CACHE_SESSIONS=0: must be at least 1" in result.output
    assert limits == [1234]  # refused before anything was rebuilt
