"""`milpa-sessions console`: serve the operator console; manage its operators."""

from __future__ import annotations

import ipaddress
import logging
import os
import tempfile
from pathlib import Path

import click

from console.auth import hash_password
from milpa_sessions import wiring
from milpa_sessions.settings import Settings
from schemas.errors import ConfigurationError

log = logging.getLogger(__name__)


def warn_if_plain(listen: str, secure: bool) -> None:
    """Log a warning when the console is to serve plain HTTP beyond this machine."""
    if not secure and not _loopback(listen):
        log.warning(
            "the console listens on %s over plain HTTP and MILPA_CONSOLE_COOKIE_SECURE is off: "
            "passwords and sign-in cookies cross the network in clear; put TLS in front and "
            "set it",
            listen,
        )


def _loopback(host: str) -> bool:
    """Whether `host` is a loopback name or address (only this machine reaches it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@click.group(invoke_without_command=True)
@click.option("--host", help="Listen address (MILPA_CONSOLE_HOST).")
@click.option("--port", type=int, help="Listen port (MILPA_CONSOLE_PORT).")
@click.option("--loglevel", default="info", show_default=True)
@click.pass_context
def console(ctx: click.Context, host: str | None, port: int | None, loglevel: str) -> None:
    """Serve the operator console (HTTP API, web pages, live updates) until interrupted."""
    if ctx.invoked_subcommand is not None:
        return
    import uvicorn  # noqa: PLC0415 - only the server needs it

    from console.app import create_app  # noqa: PLC0415

    settings = _settings(ctx)
    logging.basicConfig(level=loglevel.upper(), format="%(levelname)s %(name)s: %(message)s")
    wiring.wait_for_stack(settings)
    app = create_app(wiring.console_deps(settings), settings)
    listen = host or settings.console_host
    warn_if_plain(listen, settings.console_cookie_secure)
    uvicorn.run(
        app,
        host=listen,
        port=port or settings.console_port,
        log_level=loglevel,
        proxy_headers=False,
    )


@console.command("passwd")
@click.argument("username")
@click.option(
    "--file",
    "path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The users file (default: MILPA_CONSOLE_USERS_FILE).",
)
@click.option(
    "--password-stdin",
    "from_stdin",
    is_flag=True,
    help="Read the new password from the first line of stdin (for scripts).",
)
@click.pass_context
def passwd(ctx: click.Context, username: str, path: Path | None, from_stdin: bool) -> None:
    """Add an operator to the users file, or change its password (stored as an argon2id hash).

    The password is asked for (twice, not echoed) or read from stdin, never taken as an
    argument: a command line is readable by every user of the machine and kept in histories.
    """
    path = path or _settings(ctx).console_users_file
    if path is None:
        raise ConfigurationError("no users file: pass --file or set MILPA_CONSOLE_USERS_FILE")
    if not username or ":" in username or any(c.isspace() for c in username):
        raise click.BadParameter("a username has no colon and no spaces", param_hint="USERNAME")
    password = _read_password() if from_stdin else _ask_password()
    write_user(path, username, hash_password(password))
    click.echo(f"{username} can sign in ({path})")


def _read_password() -> str:
    """The first line of stdin, without its line ending; an empty one is refused."""
    password = click.get_text_stream("stdin").readline().rstrip("\r\n")
    if not password:
        raise click.BadParameter("stdin holds no password", param_hint="--password-stdin")
    return password


def _ask_password() -> str:
    """The password typed twice at a prompt that does not echo it."""
    password: str = click.prompt("Password", hide_input=True, confirmation_prompt=True)
    return password  # click asks again for an empty one


def _settings(ctx: click.Context) -> Settings:
    """The settings the CLI's root command read (`milpa_sessions.cli.Ctx`)."""
    settings = getattr(ctx.find_root().obj, "settings", None)
    if not isinstance(settings, Settings):
        raise ConfigurationError("the console commands run under `milpa-sessions`")
    return settings


def write_user(path: Path, username: str, hashed: str) -> None:
    """Set `username`'s hash in the users file, atomically, readable by its owner only."""
    try:
        _write_user(path, username, hashed)
    except OSError as e:
        raise ConfigurationError(f"cannot write the users file {path}: {e.strerror}") from e


def _write_user(path: Path, username: str, hashed: str) -> None:
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    kept = [line for line in lines if line.split(":", 1)[0].strip() != username]
    kept.append(f"{username}:{hashed}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("\n".join(kept) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
