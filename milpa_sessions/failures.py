"""The CLI's one error handler: the project's errors become one line on stderr and an exit code.

Every command runs inside `CleanGroup.invoke`, including the group's own callback that reads the
settings, so a bad setting, an unreachable Redis or an unreachable broker ends any command with
one line naming what failed: exit status 2 for a call the model refuses, 1 for everything else.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click
from rich.console import Console

from milpa_sessions.settings import Settings
from projections.redis_client import REDIS_ERRORS, redacted
from schemas.errors import (
    CorruptProjectionError,
    InvalidCall,
    LogError,
    MilpaError,
    ProjectionError,
)

err = Console(stderr=True, soft_wrap=True)

EXIT_REFUSED = 2  # the call was refused (bad arguments, unknown session, ...)
EXIT_FAILED = 1  # a setting, a service or the data


class CleanGroup(click.Group):
    """A click group whose commands (and sub-groups) fail with one line, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; turn the project's and the drivers' errors into one line."""
        try:
            return super().invoke(ctx)
        except InvalidCall as e:
            _fail(f"error: {e}", EXIT_REFUSED)
        except CorruptProjectionError as e:  # no retry cures it: say what does
            _fail(
                f"error: {type(e).__name__}: {e} (Redis at {_where(ctx, 'redis')}; if this "
                "command is older than the workers, upgrade it; otherwise rebuild the session "
                "with `milpa-sessions replay --session ID --force`)",
                EXIT_FAILED,
            )
        except ProjectionError as e:
            _fail(f"error: {type(e).__name__}: {e} (Redis at {_where(ctx, 'redis')})", EXIT_FAILED)
        except LogError as e:
            _fail(f"error: {type(e).__name__}: {e} (Kafka at {_where(ctx, 'kafka')})", EXIT_FAILED)
        except MilpaError as e:
            _fail(f"error: {type(e).__name__}: {e}", EXIT_FAILED)
        except REDIS_ERRORS as e:  # a driver error an adapter did not wrap: still one line
            _fail(f"error: Redis at {_where(ctx, 'redis')}: {type(e).__name__}: {e}", EXIT_FAILED)
        except Exception as e:
            if not _kafka_error(e):
                raise
            _fail(f"error: Kafka at {_where(ctx, 'kafka')}: {type(e).__name__}: {e}", EXIT_FAILED)


def _kafka_error(e: Exception) -> bool:
    """Whether `e` is kafka-python's. Read from `sys.modules`: a command that never imported
    kafka (its import costs ~0.1 s; reading commands never need it) cannot have raised one."""
    errors = sys.modules.get("kafka.errors")
    return errors is not None and isinstance(e, errors.KafkaError)


def _where(ctx: click.Context, service: str) -> str:
    settings = getattr(ctx.find_root().obj, "settings", None)
    if not isinstance(settings, Settings):
        try:
            settings = Settings.from_env(os.environ)
        except MilpaError:
            return "?"
    return settings.kafka_bootstrap if service == "kafka" else redacted(settings.redis_url)


def _fail(line: str, code: int) -> NoReturn:
    err.print(" ".join(line.split()), markup=False, highlight=False, emoji=False)
    sys.exit(code)


def close_at_end(close: Callable[[], object]) -> None:
    """Call `close` when the current command ends; what the command did is done, so its exit
    stands whether or not closing succeeds."""

    def closing() -> None:
        with contextlib.suppress(MilpaError):
            close()

    click.get_current_context().call_on_close(closing)
