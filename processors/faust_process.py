"""The Faust worker the long-running processes run under (see processors.running)."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import faust

from processors.running import quiet_repeats, start_watchdog


class Worker(faust.Worker):
    """Faust's worker with a bounded stop and rate-limited repeated log lines."""

    def __init__(self, *args: Any, grace: float = 10.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Faust's start-up spinner sets the root logger to DEBUG so that every record turns it:
        # every debug line of aiokafka, Faust and mode (several per fetch and per produce) is
        # then built and handed to the handlers, only to be dropped by their level, for as long
        # as the worker runs. A service has no terminal to spin on.
        self.spinner = None
        self.grace = grace
        self._watchdog: threading.Thread | None = None

    def _schedule_shutdown(self, signal: signal.Signals) -> None:
        if self._watchdog is None:
            self._watchdog = start_watchdog(self.grace, f"{signal.name}")
        super()._schedule_shutdown(signal)

    def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
        """Once Faust has set up logging: quiet repeated lines."""
        super().on_setup_root_logger(logger, level)
        quiet_repeats(logger)
