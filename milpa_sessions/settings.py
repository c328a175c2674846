"""The CLI's settings: every reader's, in one object read from the environment."""

from __future__ import annotations

from dataclasses import dataclass

from console.settings import WebConsoleSettings
from processors.settings import WorkerSettings
from producers.settings import StackSettings, WriterSettings


@dataclass(frozen=True)
class ConsoleSettings(StackSettings):
    """What the operator's reading commands read (`show`, `timeline`, `stats`): the stack's."""


@dataclass(frozen=True)
class Settings(WebConsoleSettings, WriterSettings, WorkerSettings, ConsoleSettings):
    """All settings: the CLI reads them once and hands each part the section it reads."""
