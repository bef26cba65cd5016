"""Errors of stream scoring."""

from __future__ import annotations

from nightshift.errors import NightshiftError


class StreamConfigError(NightshiftError):
    """A score-stream option is out of range or inconsistent."""


class StreamUnavailable(NightshiftError):
    """Redis did not answer for longer than the consumer may wait; unacknowledged inputs stay pending."""

    exit_code = 3


class NoChampion(NightshiftError):
    """The registered model has no `@champion` to score with."""
