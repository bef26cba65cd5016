"""Errors of the model search. Each names what is wrong and what to do."""

from __future__ import annotations

from nightshift.errors import NightshiftError, UsageError


class SearchSpaceInvalid(UsageError):
    """A search space (or its fixed options) is malformed or names an unknown trainer option."""


class StudyMismatch(UsageError):
    """An existing study was created with other search settings than the ones given now."""


class TrialNotRunning(NightshiftError):
    """A trainer was asked to report to a trial that is not RUNNING in its study."""


class BestConfigInvalid(UsageError):
    """The best configuration file (search/best.json) is malformed, so training cannot take its defaults."""
