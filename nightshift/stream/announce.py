"""How a deploy tells running consumers about a new champion: `SET nightshift:champion:<model> <version>`.

A consumer reads that key between batches (one GET) and loads the announced version when the value
changes; it also asks the registry for `@champion` every `champion_poll_s`, so a champion moved without
an announcement (no Redis configured at deploy time) is still picked up, only later.

`announce_champion` is called by `nightshift.deploy.deploy` after a promotion when $NIGHTSHIFT_REDIS_URL
is set; without it nothing happens, and a Redis that does not answer is a warning, never a failed deploy.
"""

from __future__ import annotations

import logging
import os

from nightshift.stream.redis_io import PASSWORD_FILE_ENV, REDIS_URL_ENV, connect, read_password_file, redact

log = logging.getLogger(__name__)
KEY_PREFIX = "nightshift:champion:"


def champion_key(model_name: str) -> str:
    return f"{KEY_PREFIX}{model_name}"


def announce_champion(model_name: str, version: str, *, url: str | None = None,
                      password: str | None = None) -> bool:
    """SET the champion key for `model_name` to `version` on `url` (default $NIGHTSHIFT_REDIS_URL, password
    from $NIGHTSHIFT_REDIS_PASSWORD_FILE when set). False when no Redis is configured or it did not answer."""
    url = url or os.environ.get(REDIS_URL_ENV)
    if not url:
        return False
    if password is None and os.environ.get(PASSWORD_FILE_ENV):
        password = read_password_file(os.environ[PASSWORD_FILE_ENV])
    try:
        import redis
    except ImportError:  # pragma: no cover - redis is a dependency; a trimmed install just skips this
        log.warning("redis-py is not installed; consumers will find %s v%s at their next registry poll",
                    model_name, version)
        return False
    client = connect(url, password=password, timeout=3.0)
    try:
        client.set(champion_key(model_name), str(version))
    except redis.RedisError as err:
        log.warning("could not announce %s v%s on %s (%s); stream consumers will find it at their next registry "
                    "poll", model_name, version, redact(url), type(err).__name__)
        return False
    finally:
        client.close()
    return True
