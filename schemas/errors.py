"""The one error hierarchy of milpa-sessions; every layer raises a subclass of `MilpaError`."""

from __future__ import annotations


class MilpaError(Exception):
    """Root of every error this project raises on purpose."""

    # A stable machine-readable code (API problem details, CLI --json); the fold's rejection
    # codes where the error is one (`session_ended`, `late_answer`, `no_open_question`, ...).
    code = "error"


# -- wire format ---------------------------------------------------------------------------------


class CodecError(MilpaError):
    """A record could not be encoded or decoded."""

    code = "codec_error"


class UnknownFingerprintError(CodecError):
    """The record names a writer schema that no schema in `schemas/` has."""

    code = "unknown_fingerprint"


class CorruptRecordError(CodecError):
    """The bytes are not a readable single-object-encoded Avro record."""

    code = "corrupt_record"


class EncodeError(CodecError):
    """A value does not fit its Avro schema."""

    code = "encode_error"


# -- the writer API ------------------------------------------------------------------------------


class InvalidCall(MilpaError):  # noqa: N818 - reads as "an invalid call"
    """An API call was given arguments the model refuses before anything is appended."""

    code = "invalid_call"


class UnknownSessionError(InvalidCall):
    """The session has not been started."""

    code = "unknown_session"


class SessionExpiredError(UnknownSessionError):
    """The session ended and its projection expired (retention); its events are still in Kafka."""

    code = "session_expired"


class SessionAlreadyStartedError(InvalidCall):
    """`start` was called for a session id that already exists."""

    code = "session_already_started"


class SessionEndedError(InvalidCall):
    """The session has ended; nothing more can be written to it."""

    code = "session_ended"


class LateAnswerError(SessionEndedError):
    """An answer came after its question's window closed: it is on record and decides nothing."""

    code = "late_answer"


class NoOpenQuestionError(InvalidCall):
    """An answer names a question that is not the session's open question."""

    code = "no_open_question"


class InvalidAnswerError(InvalidCall):
    """The answer is not one the open question takes (not an option; a signature question's
    answer other than its approval)."""

    code = "invalid_answer"


class QuestionOpenError(InvalidCall):
    """A question was asked while another one is still open."""

    code = "question_open"


class UnauthorizedError(InvalidCall):
    """The call would make a session less supervised and this writer holds no operator key."""

    code = "unauthorized"


class PolicyError(MilpaError):
    """The policy cannot decide safely (it fails closed)."""

    code = "policy_error"


class MissingCeilingError(PolicyError):
    """A child session was given no ceiling: deciding would ignore its ancestors."""

    code = "missing_ceiling"


class SignatureError(MilpaError):
    """A signature is malformed or a key cannot be loaded."""

    code = "signature_error"


# -- infrastructure ------------------------------------------------------------------------------


class BackendError(MilpaError):
    """A Kafka or Redis call failed; the driver's error is the `__cause__`."""

    code = "backend_unavailable"


class LogError(BackendError):
    """Appending to or reading from the event log failed."""

    code = "log_unavailable"


class ProducerStoppedError(LogError):
    """A send after its producer was stopped for good (shutting down): never worth a retry."""

    code = "log_unavailable"


class ProjectionError(BackendError):
    """Reading or writing a projection failed."""

    code = "projection_unavailable"


class SessionRestoringError(ProjectionError):
    """A `replay --session` of the session is under way, or died: its projection is half rebuilt
    until one runs to its end."""

    code = "session_restoring"


class CorruptProjectionError(ProjectionError):
    """A stored projection cannot be decoded: reading it again gives the same bytes (Redis was
    reached; a rebuild with `replay` is what mends it)."""

    code = "projection_corrupt"


class ReplicationLagError(ProjectionError):
    """A projection write was not acknowledged by as many Redis replicas as the settings ask for
    (`MILPA_REDIS_WAIT_REPLICAS`): the caller does not move its Kafka offsets past it."""

    code = "replication_lag"


class NotYetVisibleError(ProjectionError):
    """`load(at_least=...)` timed out before the projection applied that position."""

    code = "not_yet_visible"


class ConfigurationError(MilpaError):
    """A setting is missing or malformed."""

    code = "configuration_error"


class WorkersRunningError(MilpaError):
    """The operation needs the projector's workers stopped, and its consumer group has members."""

    code = "workers_running"


class RebuildInProgressError(MilpaError):
    """A live rebuild of these projections is under way (it holds the rebuild lease)."""

    code = "rebuild_in_progress"


class RebuildIncompleteError(RebuildInProgressError):
    """A rebuild cleared these projections and never finished: they are half built until a
    `replay` runs to its end (`Keys.rebuild_incomplete`)."""

    code = "rebuild_incomplete"
