"""Fixtures the integration modules share: headless Chromium (`browser`) and where its screenshots go
(`artifacts`), from browser_helpers."""

from tests.integration.browser_helpers import artifacts, browser

__all__ = ["artifacts", "browser"]
