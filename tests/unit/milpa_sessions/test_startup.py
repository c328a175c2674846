"""The CLI's reading commands start without kafka-python (~0.1 s of imports), and still turn a
Kafka error into one line when a command did use it."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner
from kafka.errors import KafkaTimeoutError

from milpa_sessions.failures import EXIT_FAILED, CleanGroup
from producers.kafka_log import KafkaEventLog
from schemas.errors import LogError
from tests.unit.builders import started


def test_importing_the_cli_imports_no_kafka_client() -> None:
    code = (
        "import sys, milpa_sessions.cli\n"
        "print(sorted(m for m in ('kafka', 'aiokafka', 'faust') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _group(error: Exception) -> click.Group:
    @click.group(cls=CleanGroup)
    def main() -> None:
        pass

    @main.command()
    def fail() -> None:
        raise error

    return main


def test_a_kafka_error_ends_a_command_with_one_line() -> None:
    result = CliRunner().invoke(_group(KafkaTimeoutError("no broker")), ["fail"])
    assert result.exit_code == EXIT_FAILED
    assert "Kafka at" in result.output
    assert "KafkaTimeoutError" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_any_other_error_is_not_dressed_up_as_kafkas() -> None:
    result = CliRunner().invoke(_group(RuntimeError("a bug")), ["fail"])
    assert isinstance(result.exception, RuntimeError)
    assert "Kafka at" not in result.output


class _FailingProducer:
    def send(self, *args: object, **kwargs: object) -> None:
        raise KafkaTimeoutError("metadata not available")


def test_a_producer_error_is_wrapped_in_log_error() -> None:
    log = KafkaEventLog("127.0.0.1:9", "t")
    log._client = _FailingProducer()  # type: ignore[assignment]
    with pytest.raises(LogError, match="cannot send") as caught:
        log.send(started())
    assert isinstance(caught.value.__cause__, KafkaTimeoutError)
