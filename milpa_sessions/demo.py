"""The demo an operator runs first: a simulated fleet through the real pipeline, then the facts.

Against the local stack it starts a worker process (projector + scheduler) and the operator
console, drives the fleet through Kafka, follows it live, and ends with what Redis and a
downstream subscriber hold: every session, pauses by reason with their outcomes, decisions,
expiries, and one session in full. With `console=True` the fleet keeps working and nobody
simulated answers: a person signs in to the console and answers from the browser.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import httpx
from rich.live import Live
from rich.table import Table

from console.auth import hash_password
from milpa_sessions import wiring
from milpa_sessions.console_cli import write_user
from milpa_sessions.fleet import OPERATOR, FleetConfig, FleetProgress, run_fleet
from milpa_sessions.keyfiles import write_key_pair
from milpa_sessions.render import out, render_session, render_timeline
from milpa_sessions.settings import Settings
from producers.decisions import DecisionSubscriber, PublishedDecision
from producers.memory import in_memory_backend
from producers.store import SessionStore
from producers.topics import ensure_topics
from schemas.errors import MilpaError
from session_model.ports import EventLog, ProjectionStore
from session_model.session import Session
from session_model.signing import Signer


@contextmanager
def cli_process(settings: Settings, logfile: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """A `milpa-sessions <args>` child process with `settings`, stopped (SIGTERM) on exit.

    It runs in the log's directory: a worker's Faust data directory goes there, not into the
    directory the demo was started from.
    """
    env = {**os.environ, **settings.to_env()}
    with logfile.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "milpa_sessions.cli", *args],
            env=env,
            cwd=logfile.parent,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        stop_together([proc])


def stop_together(procs: Sequence[subprocess.Popen[bytes]], grace: float = 30.0) -> None:
    """SIGTERM to each child still running, all at once, then one shared `grace` for all of them
    to exit; what is left is killed. Stopping them one after the other would add their graces."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def worker_process(settings: Settings, logfile: Path) -> ContextManager[subprocess.Popen[bytes]]:
    """A `milpa-sessions worker` child process, stopped (SIGTERM) on exit."""
    return cli_process(settings, logfile, "worker", "--loglevel", "info")


DEMO_OPERATOR = "demo"


@contextmanager
def console_process(
    settings: Settings, logfile: Path, started: list[subprocess.Popen[bytes]] | None = None
) -> Iterator[str]:
    """A `milpa-sessions console` child process on a free port; yields its URL once it answers
    (and adds the process to `started`)."""
    wanted = settings.console_port
    port = wanted if wanted and _port_free(wanted) else _free_port()
    chosen = replace(settings, console_port=port)
    url = f"http://{settings.console_host}:{port}"
    with cli_process(chosen, logfile, "console", "--loglevel", "warning") as proc:
        if started is not None:
            started.append(proc)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/login", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the console did not start: see {logfile}")
            time.sleep(0.2)
        yield url


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _progress_table(progress: FleetProgress, agents: int, started_at: float) -> Table:
    table = Table(title=f"fleet of {agents} agents — {time.monotonic() - started_at:4.1f}s")
    columns = ("started", "finished", "expired", "questions", "answers", "signed", "events")
    for column in columns:
        table.add_column("answered" if column == "answers" else column, justify="right")
    table.add_row(*(str(getattr(progress, column)) for column in columns))
    return table


def _drive(
    make_store: Callable[[str], SessionStore],
    prefix: str,
    config: FleetConfig,
    extra: Callable[[list[str], threading.Event], None] | None = None,
) -> list[str]:
    progress = FleetProgress()
    result: list[str] = []
    runner = threading.Thread(
        target=lambda: result.extend(run_fleet(make_store, prefix, config, progress, extra)),
        daemon=True,
    )
    started_at = time.monotonic()
    runner.start()
    with Live(_progress_table(progress, config.agents, started_at), console=out) as live:
        while runner.is_alive():
            runner.join(0.25)
            live.update(_progress_table(progress, config.agents, started_at))
    if not out.is_terminal:
        out.print()  # (rich ends a live display written to a file or a pipe without a newline)
    return result


def run_demo(
    settings: Settings, *, in_memory: bool, config: FleetConfig, console: bool = False
) -> None:
    """Run the fleet on the in-memory backend or through Kafka, Faust and Redis (and the console).

    `console`: keep the fleet working, with nobody simulated answering, until interrupted.
    """
    prefix = f"demo-{uuid.uuid4().hex[:6]}"
    signer = Signer.generate(OPERATOR)
    if in_memory:
        log, store = in_memory_backend(signer.trusted_keys())
        make = _factory(log, store, signer)
        scheduler = make("milpa-scheduler")

        def expire(ids: list[str], stop: threading.Event) -> None:
            while not stop.is_set():  # the in-memory stand-in for the scheduler processor
                for sid in ids:
                    if (s := scheduler.find(sid)) is not None and s.question is not None:
                        scheduler.expire_if_due(sid, datetime.now(UTC))
                stop.wait(0.05)

        ids = _drive(make, prefix, config, expire)
        _report(make("reader"), ids, decisions=None)
        return
    with tempfile.TemporaryDirectory() as tmp:
        private, trusted = write_key_pair(signer, Path(tmp))
        worker_settings = replace(settings, trusted_keys_dir=trusted)
        ensure_topics(settings)
        password = secrets.token_urlsafe(9)
        users, secret = Path(tmp) / "users", Path(tmp) / "cookie-secret"
        write_user(users, DEMO_OPERATOR, hash_password(password))
        secret.write_text(secrets.token_urlsafe(32))
        console_settings = replace(
            worker_settings,
            signing_key=private,
            console_users_file=users,
            console_secret_file=secret,
        )
        children: list[subprocess.Popen[bytes]] = []
        with (
            worker_process(worker_settings, Path(tmp) / "worker.log") as worker,
            console_process(console_settings, Path(tmp) / "console.log", children) as url,
        ):
            children.append(worker)
            try:
                out.print(
                    f"[bold]worker started[/bold] (projector + scheduler); agents write to "
                    f"{settings.events_topic} at {settings.kafka_bootstrap}, projections in Redis"
                )
                out.print(f"[bold]operator console[/bold]: {url}", highlight=False)
                out.print(f"  sign in as {DEMO_OPERATOR}, password {password}", highlight=False)
                shared = wiring.session_store(settings, producer="demo")
                try:
                    make = _factory(shared.log, shared.projections, signer, settings.read_timeout)
                    if console:
                        _keep_running(make, prefix, config, url)
                        return
                    ids = _drive(make, prefix, config)
                    reader = make("reader")
                    for sid in ids:  # read-your-writes: every agent's last event is projected
                        reader.load(sid)
                    decisions = _collect_decisions(settings, prefix, ids)
                    _report(reader, ids, decisions)
                finally:
                    # Its producer (flushed) and its Redis client; a failure to close must not
                    # hide what the demo raised, and what it showed stands: it is told.
                    try:
                        shared.close()
                    except MilpaError as e:
                        out.print(f"warning: closing the demo's store failed: {e}", markup=False)
            finally:
                stop_together(children)  # both at once, before each context's own stop


def _keep_running(
    make: Callable[[str], SessionStore], prefix: str, config: FleetConfig, url: str
) -> None:
    """The fleet works on, session after session; a person answers in the console."""
    patient = replace(config, operator=False, continuous=True, deadline_seconds=300.0)
    out.print(
        f"the fleet keeps working and waits for you: answer its questions at {url}/inbox "
        "(each waits 5 minutes); Ctrl-C stops the demo",
        highlight=False,
    )
    runner = threading.Thread(
        target=run_fleet, args=(make, prefix, patient, FleetProgress()), daemon=True
    )
    runner.start()
    try:
        while runner.is_alive():
            runner.join(1.0)
    except KeyboardInterrupt:
        out.print("stopped")


def _factory(
    log: EventLog, projections: ProjectionStore, signer: Signer, read_timeout: float = 10.0
) -> Callable[[str], SessionStore]:
    def make(producer: str) -> SessionStore:
        # Only the operator's console holds the answering key.
        key = signer if producer == OPERATOR else None
        return SessionStore(
            log, projections, producer=producer, signer=key, read_timeout=read_timeout
        )

    return make


def _collect_decisions(settings: Settings, prefix: str, ids: list[str]) -> list[PublishedDecision]:
    # A `milpa-` group: on a secured cluster the ACLs let operators read with such groups.
    subscriber = DecisionSubscriber(
        settings.kafka_access(), settings.decisions_topic, f"milpa-{prefix}-subscriber"
    )
    wanted = set(ids)
    found: list[PublishedDecision] = []
    quiet_since = time.monotonic()
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and time.monotonic() - quiet_since < 3:
            batch = [d for d in subscriber.poll() if d.session_id in wanted]
            if batch:
                found.extend(batch)
                quiet_since = time.monotonic()
    finally:
        subscriber.close()
    return found


def _status(s: Session) -> str:
    if not s.ended:
        return "waiting" if s.question else "running"
    return "expired" if s.closed_question is not None else "finished"


def _report(store: SessionStore, ids: list[str], decisions: list[PublishedDecision] | None) -> None:
    sessions = [store.load(sid) for sid in ids]
    out.rule(f"sessions ({ids[0].rsplit('-', 2)[0]}-*)")
    table = Table("session", "status", "mode", "seq", "decisions", "open todos", "why it ended")
    for s in sessions:
        if s.closed_question is not None:
            why = f"unanswered: {s.closed_question.id}"
        else:
            why = s.ended_because or ""
        table.add_row(
            s.id.rsplit("-", 2)[-2] + "-" + s.id.rsplit("-", 1)[-1],
            _status(s),
            s.mode.value,
            str(s.seq),
            str(len(s.decisions)),
            str(len(s.open_todos())),
            why,
        )
    out.print(table)

    out.rule("pauses by reason")
    asked: Counter[str] = Counter()
    outcome: Counter[tuple[str, str]] = Counter()
    for s in sessions:
        asked.update(s.pauses)
        for d in s.decisions:
            kind = "expired" if d.expired_at is not None else "answered"
            outcome[(d.reason or "unspecified", kind)] += 1
    pauses = Table("reason", "pauses", "answered", "expired", "still open")
    for reason, n in sorted(asked.items()):
        answered, expired = outcome[(reason, "answered")], outcome[(reason, "expired")]
        pauses.add_row(reason, str(n), str(answered), str(expired), str(n - answered - expired))
    out.print(pauses)

    approvals = [a for s in sessions for a in s.approvals]
    unauthorized = sum(s.rejection_counts().get("unauthorized", 0) for s in sessions)
    out.print(
        f"authority: {sum(len(s.permissions) for s in sessions)} grants and "
        f"{len(approvals)} call approvals signed by the operator "
        f"({sum(1 for a in approvals if a.consumed_at is not None)} used by their call); "
        f"unsigned authority refused: {unauthorized}"
    )
    expired_sessions = [s for s in sessions if _status(s) == "expired"]
    late = sum(s.rejection_counts().get("late_answer", 0) for s in sessions)
    out.print(
        f"expiries: {len(expired_sessions)} sessions ended because nobody answered in time; "
        f"late answers on record: {late}"
    )
    if decisions is not None:
        out.rule("decisions received by a downstream subscriber (sessions.decisions)")
        verified = sum(1 for d in decisions if d.by is not None and d.by.verified)
        windows = sum(1 for d in decisions if d.expired)
        folded = sum(len(s.decisions) for s in sessions)
        out.print(
            f"{len(decisions)} decisions received ({verified} by a verified operator, "
            f"{windows} closed windows); the projections hold {folded}"
        )
    example = expired_sessions[0] if expired_sessions else sessions[0]
    out.rule(f"one session in full: {example.id}")
    render_session(example)
    out.rule("its window (what the model is sent)")
    for m in example.window():
        out.print(f"[bold]{m.role}[/bold]: ", end="")
        out.print(m.content, markup=False, highlight=False)
    out.rule("its timeline")
    render_timeline(store.timeline(example.id))
