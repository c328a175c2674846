"""A simulated fleet for the demo: agents that work, pause, wait; an operator who answers some.

Every agent drives its own session through `SessionStore` and the policy, exactly as a real agent
would; questions it cannot resolve itself carry a reason code and a deadline. A simulated operator
answers most permission and target questions (signed, so verified); the rest are left to the
scheduler, which closes their answer windows and so ends those sessions.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from producers.store import SessionStore, deadline_in
from schemas.errors import MilpaError
from session_model.policy import (
    APPROVAL,
    SIGNATURE,
    SessionPolicy,
    Verdict,
    permission_question,
    signature_question,
    target_question,
)
from session_model.principal import Principal
from session_model.session import Question, Session

OPERATOR = "operator-console"  # the only producer in the demo that holds the operator key

GOALS = (
    "move the Inventario plugin to sqlite",
    "upgrade the billing service to the new API",
    "fix the flaky checkout test",
    "split the monolith's user module",
    "add rate limiting to the public API",
    "migrate the CI from Jenkins to the new runner",
)
MUTATING = ("make", "migrate", "write_file", "git_commit")


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """How big and how patient the simulated fleet is."""

    agents: int = 8
    seed: int = 7
    answer_ratio: float = 0.8
    deadline_seconds: float = 4.0
    operator_delay: float = 0.6
    step_pause: float = 0.05
    operator: bool = True  # False: nobody simulated answers (a person does, in the console)
    continuous: bool = False  # True: each agent starts a new session when one ends, until stopped


@dataclass
class FleetProgress:
    """Live counters the demo renders."""

    started: int = 0
    finished: int = 0
    expired: int = 0
    questions: int = 0
    answers: int = 0
    signed: int = 0  # calls that went through on a signed approval
    events: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **counts: int) -> None:
        """Add to some counters."""
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


def _ask(store: SessionStore, sid: str, q: Question, progress: FleetProgress) -> Session:
    store.ask(sid, q)
    progress.add(questions=1, events=1)
    while True:  # wait for the human or the window to close
        session = store.load(sid)
        if session.ended or session.question is None:
            return session
        time.sleep(0.1)


def run_agent(
    store: SessionStore,
    sid: str,
    index: int,
    config: FleetConfig,
    progress: FleetProgress,
    *,
    launcher: SessionStore,
) -> None:
    """One agent's working day, as a sequence of appends and policy decisions.

    The operator's `launcher` starts the session: a mode less supervised than `ask` is the
    operator's signed act, never the agent's. The agent's own store holds no operator key.
    """
    rng = random.Random(config.seed * 1000 + index)
    policy = SessionPolicy()
    mode = rng.choice(("ask", "ask", "acknowledge", "auto"))
    launcher.start(sid, GOALS[index % len(GOALS)], mode=mode)
    launcher.load(sid)  # the agent starts working once the session it was given is visible
    store.set_plan(sid, "read, change, verify")
    for t in ("read", "change", "verify"):
        store.set_todo(sid, t, f"{t} the code")
    progress.add(started=1, events=5)
    for step in range(rng.randint(3, 6)):
        time.sleep(config.step_pause)
        store.record_turn(sid, "assistant", f"step {step}: looking at module {rng.randint(1, 9)}")
        store.record_tool_call(sid, "read_file", {"path": f"src/m{step}.py"}, "120 lines")
        progress.add(events=2)
        op = rng.choice(MUTATING)
        arguments = {"step": step, "target": f"module-{step}"}
        # A signature-gated call now and then; the first agent's first one always (the demo
        # shows a signed call going through).
        needs_signature = rng.random() < 0.04 or (index == 0 and step == 0)
        roll = rng.random()
        session = store.load(sid)
        deadline = deadline_in(datetime.now(UTC), config.deadline_seconds)
        verdict = policy.decide(
            session, op, mutating=True, requires_signature=needs_signature, arguments=arguments
        )
        if roll < 0.12:
            question = target_question(
                op, f"module-{step}", f"Did you mean module-{step}?", deadline
            )
        elif roll < 0.2:
            question = Question(f"free:{step}", "Which style guide applies?", ("pep8", "black"))
            question = Question(question.id, question.question, question.options, None, deadline)
        elif verdict is Verdict.REQUIRE_SIGNATURE:
            question = signature_question(op, arguments, deadline)
        elif verdict is Verdict.ASK_PERMISSION:
            question = permission_question(op, arguments, deadline)
        else:
            question = None
        if question is not None:
            session = _ask(store, sid, question, progress)
            if session.ended:
                progress.add(expired=1)
                return
            # Not on the answer's word: anyone who can append may write a yes. The call goes
            # ahead only if the policy allows it now, which reads what the operator signed (the
            # grant that comes with a yes, see run_operator; the approval of exactly this call).
            verdict = policy.decide(
                session, op, mutating=True, requires_signature=needs_signature, arguments=arguments
            )
            if verdict is not Verdict.ALLOW:
                continue
            if question.reason == "signature":
                progress.add(signed=1)
        store.record_tool_call(sid, op, arguments, "ok", mutating=True, artifact=f"src/m{step}.py")
        store.set_todo(sid, "change", "change the code", "in_progress")
        progress.add(events=2)
    store.set_todo(sid, "read", "read the code", "done")
    store.end(sid, "work finished")
    progress.add(finished=1, events=2)


def run_operator(
    store: SessionStore,
    session_ids: list[str],
    config: FleetConfig,
    progress: FleetProgress,
    stop: threading.Event,
) -> None:
    """Answer most open questions after a delay; sign the exact call a signature question names."""
    rng = random.Random(config.seed)
    operator = Principal("actor:member:42", verified=True)
    seen: dict[tuple[str, str, int], float] = {}
    while not stop.is_set():
        for sid in session_ids:
            session = store.find(sid)
            q = session.question if session is not None else None
            if session is None or q is None or session.ended:
                continue
            key = (sid, q.id, q.seq)
            first_seen = seen.setdefault(key, time.monotonic())
            if time.monotonic() - first_seen < config.operator_delay:
                continue
            if q.reason != "signature" and rng.random() > config.answer_ratio:
                seen[key] = float("inf")  # left to expire
                continue
            answer = q.options[0] if q.options and rng.random() < 0.85 else (q.options or ("",))[-1]
            if q.reason == SIGNATURE:
                answer = APPROVAL  # the console shows the call; the store signs exactly it
            try:
                if q.reason == "permission" and answer == "yes":
                    # The grant first: it is the operator's signed act the agent then relies on.
                    store.grant(sid, q.id.removeprefix("perm:"))
                    progress.add(events=1)
                store.answer(sid, q.id, answer, operator, executor="operator-console")
                progress.add(answers=1, events=1)
            except MilpaError:
                pass  # the window closed first: the late attempt is on record
            seen[key] = float("inf")
        stop.wait(0.15)


def _agent_shifts(
    store: SessionStore,
    sid: str,
    index: int,
    config: FleetConfig,
    progress: FleetProgress,
    *,
    launcher: SessionStore,
) -> None:
    """Session after session (`sid`, `sid-2`, ...) for as long as the process runs."""
    for shift in itertools.count(1):
        name = sid if shift == 1 else f"{sid}-{shift}"
        run_agent(store, name, index + shift * 1000, config, progress, launcher=launcher)


def run_fleet(
    make_store: Callable[[str], SessionStore],
    prefix: str,
    config: FleetConfig,
    progress: FleetProgress,
    extra: Callable[[list[str], threading.Event], None] | None = None,
) -> list[str]:
    """Run every agent and the operator to completion; returns the session ids."""
    ids = [f"{prefix}-agent-{i:02d}" for i in range(config.agents)]
    stop = threading.Event()
    helpers = []
    if config.operator:
        helpers.append(
            threading.Thread(
                target=run_operator,
                args=(make_store(OPERATOR), ids, config, progress, stop),
                daemon=True,
            )
        )
    if extra is not None:
        helpers.append(threading.Thread(target=extra, args=(ids, stop), daemon=True))
    agents = [
        threading.Thread(
            target=_agent_shifts if config.continuous else run_agent,
            args=(make_store(f"agent-{i}"), sid, i, config, progress),
            kwargs={"launcher": make_store(OPERATOR)},
            daemon=True,
        )
        for i, sid in enumerate(ids)
    ]
    for t in (*helpers, *agents):
        t.start()
    for t in agents:
        t.join()
    stop.set()
    for t in helpers:
        t.join(timeout=5)
    return ids
