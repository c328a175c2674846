"""Progress receipts: did a window of calls measurably grow anything?

These facts measure progress; they do not certify that a goal is complete and they change no
authorisation. Identities (artifacts and behavioural evidence) count once per session, across
windows too, so repeating work never reads as new progress.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from session_model.session import CallFact, Observation


class Facts(Protocol):
    """Calls and observations in seq order, and the seq they reach: a `History` (complete) or a
    `Session` (its recent part only: since the last summary)."""

    @property
    def seq(self) -> int:
        """The seq of the last event."""
        ...

    @property
    def calls(self) -> tuple[CallFact, ...]:
        """The tool calls."""
        ...

    @property
    def observations(self) -> tuple[Observation, ...]:
        """The effect observations."""
        ...


class ProgressStatus(StrEnum):
    """What a window of calls proves."""

    GREW = "grew"
    NO_GROWTH = "no_growth"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class ProgressReceipt:
    """The measured progress of calls with `since < seq <= until`."""

    status: ProgressStatus
    new_identities: tuple[str, ...]
    since: int
    until: int

    @classmethod
    def for_window(cls, session: Facts, since: int, until: int | None = None) -> ProgressReceipt:
        """Measure the calls in `(since, until]` (until defaults to the session's seq).

        Identities count once per session, so the receipt of a long session needs every call
        before the window: pass its `History` (a `Session` holds only what its last summary did
        not cover).
        """
        end = session.seq if until is None else until
        observations = {o.event_id: o for o in session.observations}
        links = Counter(c.effect_observation_id for c in session.calls if c.effect_observation_id)
        seen: set[str] = set()
        for call in session.calls:
            if call.seq <= since:
                observation = _trusted_observation(call, observations, links)
                if observation is not None:
                    seen.update(_identities(observation))
        new: list[str] = []
        proxy_growth = False
        unknown = False
        for call in session.calls:
            if not since < call.seq <= end:
                continue
            if call.effect_observation_id is None:
                # The historical proxy for calls nobody measured.
                proxy_growth = proxy_growth or call.mutating
                continue
            observation = _trusted_observation(call, observations, links)
            if observation is None:
                unknown = True
                continue
            for identity in _identities(observation):
                if identity not in seen:
                    seen.add(identity)
                    new.append(identity)
        if new or proxy_growth:
            status = ProgressStatus.GREW
        elif unknown:
            status = ProgressStatus.UNKNOWN
        else:
            status = ProgressStatus.NO_GROWTH
        return cls(status, tuple(new), since, end)


def _trusted_observation(
    call: CallFact, observations: dict[str, Observation], links: Counter[str]
) -> Observation | None:
    """The observation a call links to, if it can be believed: present, known, and not reused."""
    link = call.effect_observation_id
    if link is None or links[link] > 1:
        return None
    observation = observations.get(link)
    if observation is None or not observation.known:
        return None
    return observation


def _identities(observation: Observation) -> tuple[str, ...]:
    return (
        *(f"artifact:{a}" for a in observation.artifacts),
        *(f"evidence:{e}" for e in observation.evidence),
    )
