"""`milpa-sessions`: run the worker, manage topics, read and steer sessions, replay, demo."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from milpa_sessions import wiring
from milpa_sessions.console_cli import console
from milpa_sessions.failures import CleanGroup, close_at_end
from milpa_sessions.render import (
    add_literal_row,
    out,
    render_session,
    render_timeline,
    session_summary,
)
from milpa_sessions.settings import Settings
from milpa_sessions.stats_cli import stats
from producers.store import SessionStore
from schemas.errors import (
    CorruptProjectionError,
    InvalidCall,
    MilpaError,
    SessionExpiredError,
    SessionRestoringError,
    UnknownSessionError,
    WorkersRunningError,
)
from session_model.deadlines import format_instant
from session_model.policy import SIGNATURE, check_signature_answer
from session_model.principal import Principal
from session_model.session import Session

err = Console(stderr=True)

# What only one command needs (the demo, replays, aiokafka, rich's progress bars) is imported
# inside that command: every `milpa-sessions show` or `answer` is a process of its own,
# and would pay for all of them at start-up.

F = TypeVar("F", bound=Callable[..., Any])
_REDRAW_S = 0.1  # how often a progress bar is redrawn at most


@dataclass
class Ctx:
    """What every command gets: the settings and the output format."""

    settings: Settings
    as_json: bool


def _emit(ctx: Ctx, data: Any, render: Callable[[], None]) -> None:
    if ctx.as_json:
        out.print_json(json.dumps(data, default=str, ensure_ascii=False))
    else:
        render()


@click.group(cls=CleanGroup)
@click.option("--kafka", "kafka", help="Kafka bootstrap (MILPA_KAFKA_BOOTSTRAP).")
@click.option("--redis", "redis_url", help="Redis URL (MILPA_REDIS_URL).")
@click.option("--topic", "events_topic", help="Events topic (MILPA_EVENTS_TOPIC).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.pass_context
def main(
    click_ctx: click.Context,
    kafka: str | None,
    redis_url: str | None,
    events_topic: str | None,
    as_json: bool,
) -> None:
    """Long-running AI-agent sessions as event-sourced streams over Kafka and Redis."""
    settings = Settings.from_env(
        os.environ, kafka_bootstrap=kafka, redis_url=redis_url, events_topic=events_topic
    )
    click_ctx.obj = Ctx(settings, as_json)


pass_ctx = click.make_pass_decorator(Ctx)


# -- running -------------------------------------------------------------------------------------


@main.command()
@click.option("--loglevel", default="warning", show_default=True)
@pass_ctx
def worker(ctx: Ctx, loglevel: str) -> None:
    """Run the projector (a Faust worker in the consumer group)."""
    from processors.app import create_app  # noqa: PLC0415 - Faust's import-time cost
    from processors.faust_process import Worker  # noqa: PLC0415

    keys = wiring.trusted_keys(ctx.settings)
    wiring.check_worker_settings(ctx.settings)
    endpoint, starting = wiring.serve_while_starting(ctx.settings)
    wiring.wait_for_stack(ctx.settings, starting)
    wiring.check_rebuild_finished(
        ctx.settings, why="workers folding now would build on a half-built projection"
    )
    wiring.checked_cutover(ctx.settings)  # the app folds with settings.cutover(): this one
    projector = create_app(ctx.settings, keys, endpoint=endpoint)
    # Everything allocated so far lives as long as the process: freeze it out of the collector,
    # and collect the young generation only after a million net allocations. Reference counting
    # frees a batch's objects; what a collection finds is the batches in flight (two of up to
    # 4,000 records) and the states cached meanwhile, traversed for nothing: at 100,000 the
    # collections cost ~5 % of the worker's CPU, and full collections over the caches were the
    # 100-300 ms stalls in the latency profiles (docs/PERFORMANCE.md). The price: a collection,
    # when the cache has grown by a million objects, takes longer (~0.5 s), and cyclic garbage
    # (a few dozen objects per million events here) waits that long.
    gc.collect()
    gc.freeze()
    gc.set_threshold(1_000_000, 20, 100)
    Worker(
        projector.app, loglevel=loglevel, quiet=True, grace=ctx.settings.shutdown_grace
    ).execute_from_commandline()


@main.command()
@click.option("--loglevel", default="warning", show_default=True)
@click.option(
    "--poll-interval",
    default=0.1,
    show_default=True,
    type=click.FloatRange(min=0.01),
    help="Seconds between reads of the due-work indexes.",
)
@pass_ctx
def scheduler(ctx: Ctx, loglevel: str, poll_interval: float) -> None:
    """Run the scheduler on its own (run workers with MILPA_SCHEDULER_ENABLED=false)."""
    from processors.faust_process import Worker  # noqa: PLC0415 - Faust's import-time cost
    from processors.scheduler_app import create_scheduler_app  # noqa: PLC0415

    wiring.check_worker_settings(ctx.settings)
    endpoint, starting = wiring.serve_while_starting(ctx.settings)
    wiring.wait_for_stack(ctx.settings, starting)
    wiring.check_rebuild_finished(
        ctx.settings,
        why="a scheduler now would read due-work indexes the rebuild has not refilled, "
        "and miss the deadlines and compactions not in them",
    )
    app = create_scheduler_app(ctx.settings, poll_interval=poll_interval, endpoint=endpoint)
    gc.collect()  # as in the worker: the start-up heap never needs scanning again
    gc.freeze()
    Worker(
        app.app, loglevel=loglevel, quiet=True, grace=ctx.settings.shutdown_grace
    ).execute_from_commandline()


@main.group()
def topics() -> None:
    """Kafka topics."""


@topics.command("create")
@pass_ctx
def topics_create(ctx: Ctx) -> None:
    """Create the events, decisions and dead-letter topics (idempotent)."""
    from producers.topics import ensure_topics  # noqa: PLC0415 - start-up time: see the top

    result = ensure_topics(ctx.settings)

    def render() -> None:
        for name, state in result.items():
            out.print(f"{name}: {state}")

    _emit(ctx, result, render)


@main.group()
def acls() -> None:
    """Kafka ACLs of a secured cluster."""


@acls.command("apply")
@click.option("--agent", default="agent", show_default=True, help="The agents' SCRAM user.")
@click.option("--worker", default="worker", show_default=True, help="The workers' SCRAM user.")
@click.option("--operator", default="operator", show_default=True, help="Operators' SCRAM user.")
@pass_ctx
def acls_apply(ctx: Ctx, agent: str, worker: str, operator: str) -> None:
    """Allow each role what it needs, no more (run with an administrator's credentials); returns
    once the broker enforces the ACLs."""
    from producers.acls import Principals, apply_acls  # noqa: PLC0415 - start-up time: see the top

    created = apply_acls(ctx.settings, Principals(agent, worker, operator))
    _emit(ctx, {"created": created}, lambda: out.print(f"{created} ACL(s) in place"))


@main.command("replay")
@click.option("--session", "session_id", help="Rebuild one session only.")
@click.option("--force", is_flag=True, help="Rebuild even while workers of the group are running.")
@click.option(
    "--full",
    is_flag=True,
    help="Fold the whole log, ignoring snapshots (and so rebuild every history list too; "
    "--session always does).",
)
@click.option(
    "--live",
    is_flag=True,
    help="Rebuild while the workers run: into a new projection generation, which readers and "
    "workers switch to partition by partition once it has caught up; the old one is dropped.",
)
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    help="Processes that fold partitions side by side, at most one per partition [default: one "
    "per CPU]. Fewer leave cores to workers on the same machine during a --live rebuild.",
)
@pass_ctx
def replay_cmd(
    ctx: Ctx, *, session_id: str | None, force: bool, full: bool, live: bool, processes: int | None
) -> None:
    """Drop and rebuild projections from the snapshots and the topic (refused while workers are
    running, unless --live). After a full rebuild, snapshots every session so the next one
    starts from them."""
    if live:
        if session_id is not None:
            raise click.UsageError("--live rebuilds every projection: it takes no --session")
        _replay_live(ctx, full, processes)
        return
    from processors.replay import replay  # noqa: PLC0415
    from producers.topics import group_members  # noqa: PLC0415

    running = [] if force else group_members(ctx.settings)
    if running:
        raise WorkersRunningError(
            f"{len(running)} worker(s) of group {ctx.settings.consumer_group} are running "
            f"({', '.join(running)}): stop them before a replay, or a worker committing during the "
            "rebuild can fold new events onto an emptied state (a worker killed without a clean "
            "stop stays listed until its session times out; --force to rebuild anyway)"
        )
    settings = ctx.settings
    snapshots = settings.snapshot_interval_s > 0
    store = wiring.projection_store_for_rebuild(settings)
    close_at_end(store.close)
    with _progress_bar("replaying") as progress:
        report = replay(
            settings.kafka_access(),
            settings.events_topic,
            store,
            wiring.trusted_keys(settings),
            session_id=session_id,
            progress=progress,
            processes=processes,
            start_mode=settings.start_mode(),
            cutover=wiring.checked_cutover(settings),
            # One session (a restore after retention) comes back whole, history and all.
            snapshots_topic=(
                settings.snapshots_topic if snapshots and not full and session_id is None else None
            ),
            cache_limit=settings.rebuild_cache_limit(),
        )
    taken = 0
    snapshot_error = ""
    if snapshots and session_id is None:
        try:
            taken = wiring.take_snapshots(settings, report.applied_through(), report.trust)
        except MilpaError as e:
            # The rebuild stands. The snapshots and checkpoints it did not replace stay: the next
            # rebuild ignores those of other trust inputs (it folds their partitions from offset
            # 0) and starts from the others, of the same fold as this one.
            snapshot_error = str(e)
    data = {
        "records": report.records,
        "sessions": report.applied_sessions,
        "processes": report.processes,
        "refused": dict(report.refused),
        "restored_from_snapshots": report.restored,
        "retired_from_snapshots": report.retired,
        "snapshots_ignored": dict(report.ignored),
        "offsets_skipped": report.skipped,
        "snapshots_taken": taken,
        "snapshot_error": snapshot_error or None,
    }
    refused = ", ".join(f"{n} {code}" for code, n in sorted(report.refused.items()))
    ignored = ", ".join(f"{n} {why}" for why, n in sorted(report.ignored.items()))
    expired = f" and {report.retired} expired sessions' tombstones" if report.retired else ""

    def say() -> None:
        out.print(
            f"replayed {report.records} records into {report.applied_sessions} sessions"
            f" ({report.refused_total} refused{': ' + refused if refused else ''});"
            f" {report.restored} restored from snapshots{expired}, {report.skipped} records"
            f" before the checkpoints not read; {taken} snapshots taken"
        )
        if ignored:
            err.print(f"warning: snapshots ignored ({ignored}): their sessions were folded whole")
        if snapshot_error:
            err.print(
                Text(f"warning: the rebuild stands, but snapshotting it failed: {snapshot_error}")
            )

    _emit(ctx, data, say)


@contextlib.contextmanager
def _progress_bar(label: str) -> Iterator[Callable[[int, int], None]]:
    """A transient progress bar on stderr, fed `(done, total)`, redrawn by the caller's thread.

    Rich redraws from a thread of its own unless told not to. A rebuild forks its processes only
    from a process that runs no other thread (`processors.replay`), so that thread made every
    rebuild the CLI ran fold in one process: about half the speed on two cores.
    """
    from rich.progress import Progress  # noqa: PLC0415 - start-up time: see the top

    with Progress(console=err, transient=True, auto_refresh=False) as bar:
        task = bar.add_task(label, total=None)
        drawn = 0.0

        def progress(done: int, total: int) -> None:
            nonlocal drawn
            bar.update(task, completed=done, total=total)
            now = time.monotonic()
            if now - drawn >= _REDRAW_S:
                drawn = now
                bar.refresh()

        yield progress


def _replay_live(ctx: Ctx, full: bool, processes: int | None) -> None:
    from processors.generations import rebuild_live  # noqa: PLC0415

    settings = ctx.settings
    snapshots = settings.snapshot_interval_s > 0 and not full
    store = wiring.projection_store_for_rebuild(settings)
    close_at_end(store.close)
    with _progress_bar("rebuilding (live)") as progress:
        report = rebuild_live(
            settings.kafka_access(),
            settings.events_topic,
            store,
            wiring.trusted_keys(settings),
            start_mode=settings.start_mode(),
            cutover=wiring.checked_cutover(settings),
            snapshots_topic=settings.snapshots_topic if snapshots else None,
            progress=progress,
            processes=processes,
            cache_limit=settings.rebuild_cache_limit(),
        )
    first = report.first_pass
    data = {
        "generation": report.generation,
        "records": first.records,
        "sessions": first.applied_sessions,
        "processes": first.processes,
        "refused": dict(first.refused),
        "restored_from_snapshots": first.restored,
        "retired_from_snapshots": first.retired,
        "caught_up": report.caught_up,
        "rounds": report.rounds,
        "old_keys_dropped": report.dropped,
    }

    def say() -> None:
        out.print(
            f"rebuilt generation {report.generation} live: {first.records} records into "
            f"{first.applied_sessions} sessions ({first.refused_total} refused, {first.restored} "
            f"restored from snapshots), then {report.caught_up} records caught up in "
            f"{report.rounds} round(s); every partition switched, {report.dropped} old keys dropped"
        )

    _emit(ctx, data, say)


# -- reading -------------------------------------------------------------------------------------


def _store(ctx: Ctx) -> SessionStore:
    """The command's store; its producer is flushed and closed, and its Redis connections, when
    the command ends (a command run in a process that goes on, as under CliRunner, must not
    leave its connections open)."""
    store = wiring.session_store(ctx.settings, producer="cli")
    close_at_end(functools.partial(store.close, timeout=5.0))
    return store


def _load(ctx: Ctx, store: SessionStore, session_id: str) -> Session:
    """The session; `SessionExpiredError` (how to restore it) when its projection expired."""
    try:
        return store.load(session_id)
    except UnknownSessionError as e:
        expired = store.projections.expired(session_id)
        if expired is None:
            raise
        raise SessionExpiredError(
            f"session {session_id!r} ended and its projection expired at "
            f"{format_instant(expired.at)} (retention); its history is in Kafka: restore it "
            f"with `milpa-sessions replay --session {session_id}`"
        ) from e


_LISTED = ("mode", "seq", "open_todos", "goal")  # the columns after the id and status


@main.command("list")
@pass_ctx
def list_cmd(ctx: Ctx) -> None:
    """Every session with its status."""
    projections = wiring.projection_store(ctx.settings)
    close_at_end(projections.close)
    rows: list[dict[str, Any]] = []
    for sid in projections.ids():
        try:
            s = projections.load(sid)
        except SessionRestoringError:  # half rebuilt: nothing of it is shown
            rows.append({"id": sid, "status": "restoring"} | dict.fromkeys(_LISTED))
            continue
        except CorruptProjectionError as e:  # damaged: listed as such, the others still are
            err.print(
                f"warning: {e} (rebuild the session with `milpa-sessions replay --session ID "
                "--force`)",
                markup=False,
                highlight=False,
                emoji=False,
                soft_wrap=True,
            )
            rows.append({"id": sid, "status": "unreadable"} | dict.fromkeys(_LISTED))
            continue
        if s is not None:
            rows.append(session_summary(s))

    def render() -> None:
        table = Table("session", "status", "mode", "seq", "open todos", "goal")
        for r in rows:
            add_literal_row(
                table,
                r["id"],
                r["status"],
                *("-" if r[f] is None else str(r[f]) for f in _LISTED),
            )
        out.print(table)

    _emit(ctx, rows, render)


@main.command()
@click.argument("session_id")
@pass_ctx
def show(ctx: Ctx, session_id: str) -> None:
    """One session: state, todos, decisions, rejections."""
    store = _store(ctx)
    s = _load(ctx, store, session_id)
    history = store.facts(session_id)
    data = session_summary(s)
    data["todos"] = [
        {"id": t.id, "text": t.text, "status": t.status, "version": t.version, "origin": t.origin}
        for t in s.todos
    ]
    data["decisions_detail"] = [
        {
            "question": d.question,
            "answer": d.answer,
            "by": d.by.to_record() if d.by else None,
            "reason": d.reason,
            "expired_at": format_instant(d.expired_at) if d.expired_at else None,
        }
        for d in history.decisions
    ]
    _emit(ctx, data, lambda: render_session(s, history))


@main.command()
@click.argument("session_id")
@pass_ctx
def window(ctx: Ctx, session_id: str) -> None:
    """What the model would be sent now."""
    messages = _load(ctx, _store(ctx), session_id).window()
    data = [{"role": m.role, "content": m.content} for m in messages]

    def render() -> None:
        for m in messages:
            out.print(Text.assemble((m.role, "bold"), ": ", m.content))

    _emit(ctx, data, render)


@main.command()
@click.argument("session_id")
@click.option("--since", default=0, show_default=True, help="Only entries after this seq.")
@click.option("--follow", is_flag=True, help="Keep printing new entries.")
@pass_ctx
def timeline(ctx: Ctx, session_id: str, since: int, follow: bool) -> None:
    """The session's timeline (what a board shows)."""
    store = _store(ctx)
    _load(ctx, store, session_id)  # an unknown or expired session fails as `show` does
    while True:
        entries = store.timeline(session_id, since)
        if entries:
            _emit(ctx, entries, functools.partial(render_timeline, entries))
            since = entries[-1]["seq"]
        if not follow:
            return
        time.sleep(0.5)


# -- steering ------------------------------------------------------------------------------------


@main.command()
@click.argument("session_id")
@click.argument("question_id")
@click.argument("answer")
@click.option("--by", "by", help="Principal id (default: cli:<user>@<host>, unverified).")
@click.option("--verified", is_flag=True, help="Claim a verified identity (needs a signing key).")
@click.option("--yes", is_flag=True, help="Sign a signature question's call without asking.")
@pass_ctx
def answer(  # noqa: PLR0917 - click passes every argument and option positionally
    ctx: Ctx,
    session_id: str,
    question_id: str,
    answer: str,
    by: str | None,
    verified: bool,
    yes: bool,
) -> None:
    """Answer a session's open question (a signature question: sign its exact call)."""
    store = _store(ctx)
    if verified and store.signer is None:
        raise InvalidCall("--verified needs MILPA_SIGNING_KEY (an Ed25519 PEM private key)")
    question = store.load(session_id).question
    # The asking shown here is the one answered (and signed), or nothing: an agent asking the
    # same id again in between (another call) gets a 409, not the operator's signature.
    asked_seq = question.seq if question is not None and question.id == question_id else None
    if question is not None and question.id == question_id and question.reason == SIGNATURE:
        check_signature_answer(question, answer)  # before the prompt to sign
        operation, digest = question.signed_call()
        # Agent-written, shown as is: markup in `why` could hide part of the call signed, and
        # rich's own line breaks could hide a space in it (the terminal wraps instead).
        err.print(
            Text(f"signing exactly this call in {session_id}: {operation} {question.why}"),
            soft_wrap=True,
        )
        err.print(f"(argument digest {digest}; the approval allows this call once)")
        if not yes and not click.confirm("sign it?", err=True):
            raise InvalidCall("not signed: nothing was appended")
    principal = (
        Principal(by, verified=verified)
        if by
        else Principal.from_terminal(os.environ.get("USER", "unknown"), os.uname().nodename)
    )
    position = store.answer(
        session_id, question_id, answer, principal, executor="cli", asked_seq=asked_seq
    )
    _emit(ctx, {"position": str(position)}, lambda: out.print(f"answered at {position}"))


def _steer(name: str, action: Callable[[SessionStore, str, str], Any], help_: str) -> None:
    @main.command(name=name, help=help_)
    @click.argument("session_id")
    @click.argument("value")
    @pass_ctx
    def command(ctx: Ctx, session_id: str, value: str) -> None:
        position = action(_store(ctx), session_id, value)
        _emit(
            ctx, {"position": str(position)}, lambda: out.print(f"{name}: appended at {position}")
        )


_steer("grant", lambda s, sid, v: s.grant(sid, v), "Grant an operation in a session.")
_steer("revoke", lambda s, sid, v: s.revoke(sid, v), "Revoke a granted operation.")
_steer("mode", lambda s, sid, v: s.set_mode(sid, v), "Change the autonomy mode.")
_steer("end", lambda s, sid, v: s.end(sid, v), "End a session with a reason.")


@main.group()
def keys() -> None:
    """Answering keys."""


@keys.command("generate")
@click.argument("key_id")
@click.option("--dir", "directory", type=click.Path(path_type=Path), default=Path("."))
def keys_generate(key_id: str, directory: Path) -> None:
    """Write <dir>/<key_id>.key (private) and <dir>/trusted/<key_id>.pem (public)."""
    from milpa_sessions.keyfiles import write_key_pair  # noqa: PLC0415 - start-up time: see the top
    from session_model.signing import Signer  # noqa: PLC0415

    private, trusted = write_key_pair(Signer.generate(key_id), directory)
    out.print(f"wrote {private} and {trusted / (key_id + '.pem')}")


# -- the demo ------------------------------------------------------------------------------------


@main.command()
@click.option("--in-memory", is_flag=True, help="Use the in-memory backend (no Kafka, no Redis).")
@click.option("--agents", default=8, show_default=True, help="How many simulated agents.")
@click.option("--seed", default=7, show_default=True, help="Seed of the simulated fleet.")
@click.option(
    "--console",
    "keep_console",
    is_flag=True,
    help="Keep the fleet working, unanswered, so you can answer from the console (Ctrl-C stops).",
)
@pass_ctx
def demo(ctx: Ctx, in_memory: bool, agents: int, seed: int, keep_console: bool) -> None:
    """Run a simulated fleet through the real pipeline and show what an operator sees."""
    if in_memory and keep_console:
        raise click.UsageError("--console needs the real stack (the console reads Redis)")
    from milpa_sessions.demo import run_demo  # noqa: PLC0415 - start-up time: see the top
    from milpa_sessions.fleet import FleetConfig  # noqa: PLC0415

    config = FleetConfig(agents=agents, seed=seed)
    run_demo(ctx.settings, in_memory=in_memory, config=config, console=keep_console)


main.add_command(stats)
main.add_command(console)


if __name__ == "__main__":
    main()
