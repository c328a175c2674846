"""The worker's Faust process: logging set up at the level asked, not at DEBUG for a spinner."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import faust
import pytest

from processors.faust_process import Worker


@pytest.fixture
def root_logging() -> Iterator[None]:
    """Put the root logger back as it was (the worker sets it up)."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    root.handlers[:] = handlers


@pytest.mark.usefixtures("root_logging")
def test_a_worker_at_warning_does_not_build_the_debug_records_of_its_clients() -> None:
    app = faust.App("unit-faust-process", broker="kafka://127.0.0.1:1", autodiscover=False)
    worker = Worker(app, loglevel="warning", quiet=True, stdout=io.StringIO())
    worker._setup_logging()
    client = logging.getLogger("aiokafka.consumer.fetcher")
    assert logging.getLogger().level == logging.WARNING
    assert not client.isEnabledFor(logging.DEBUG)
    assert client.isEnabledFor(logging.WARNING)
