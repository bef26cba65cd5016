"""Errors of stream scoring."""

from __future__ import annotations

from typing import Any

from nightshift.errors import NightshiftError


class StreamConfigError(NightshiftError):
    """A score-stream option is out of range or inconsistent."""


class StreamUnavailable(NightshiftError):
    """Redis did not answer for longer than the consumer may wait; unacknowledged inputs stay pending."""

    exit_code = 3


class NoChampion(NightshiftError):
    """The registered model has no `@champion` to score with."""


class StreamTargetError(StreamConfigError):
    """A key the consumer reads or writes holds another Redis type (WRONGTYPE); nothing was written."""


class ModelFailure(NightshiftError):
    """The model raised while scoring inputs that passed validation; they stay pending and are retried."""

    def __init__(self, message: str, *, rejected: list[Any] | None = None, valid: list[Any] | None = None) -> None:
        super().__init__(message)
        self.rejected: list[Any] = rejected or []  # records.Rejected: the batch's inputs at fault themselves
        self.valid: list[Any] = valid or []  # records.InputRow: the rows that passed validation, still unscored


class RedisClusterUnsupported(StreamConfigError):
    """The Redis is a Cluster: one script touches keys of many slots (CROSSSLOT), so score-stream refuses it."""


class GroupGone(NightshiftError):
    """The consumer group vanished under a running consumer while its stream holds entries; not re-created."""
