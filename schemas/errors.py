"""The one error hierarchy of milpa-sessions; every layer raises a subclass of `MilpaError`."""

from __future__ import annotations


class MilpaError(Exception):
    """Root of every error this project raises on purpose."""


# -- wire format ---------------------------------------------------------------------------------


class CodecError(MilpaError):
    """A record could not be encoded or decoded."""


class UnknownFingerprintError(CodecError):
    """The record names a writer schema that no schema in `schemas/` has."""


class CorruptRecordError(CodecError):
    """The bytes are not a readable single-object-encoded Avro record."""


class EncodeError(CodecError):
    """A value does not fit its Avro schema."""


# -- the writer API ------------------------------------------------------------------------------


class InvalidCall(MilpaError):  # noqa: N818 - reads as "an invalid call"
    """An API call was given arguments the model refuses before anything is appended."""


class UnknownSessionError(InvalidCall):
    """The session has not been started."""


class SessionAlreadyStartedError(InvalidCall):
    """`start` was called for a session id that already exists."""


class SessionEndedError(InvalidCall):
    """The session has ended; nothing more can be written to it."""


class NoOpenQuestionError(InvalidCall):
    """An answer names a question that is not the session's open question."""


class QuestionOpenError(InvalidCall):
    """A question was asked while another one is still open."""


class UnauthorizedError(InvalidCall):
    """The call would make a session less supervised and this writer holds no operator key."""


class PolicyError(MilpaError):
    """The policy cannot decide safely (it fails closed)."""


class MissingCeilingError(PolicyError):
    """A child session was given no ceiling: deciding would ignore its ancestors."""


class SignatureError(MilpaError):
    """A signature is malformed or a key cannot be loaded."""


# -- infrastructure ------------------------------------------------------------------------------


class BackendError(MilpaError):
    """A Kafka or Redis call failed; the driver's error is the `__cause__`."""


class LogError(BackendError):
    """Appending to or reading from the event log failed."""


class ProjectionError(BackendError):
    """Reading or writing a projection failed."""


class NotYetVisibleError(ProjectionError):
    """`load(at_least=...)` timed out before the projection applied that position."""


class ConfigurationError(MilpaError):
    """A setting is missing or malformed."""


class WorkersRunningError(MilpaError):
    """The operation needs the projector's workers stopped, and its consumer group has members."""
