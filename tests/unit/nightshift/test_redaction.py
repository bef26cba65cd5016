"""One redaction for every message and log that shows a URL: a password in the userinfo, in a query
parameter or in a key=value DSN never shows."""

from __future__ import annotations

import pytest

from nightshift import events
from nightshift.stream import redis_io


@pytest.mark.parametrize("redact", [events.redact, redis_io.redact], ids=["events", "stream"])
@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@127.0.0.1:6390/0", "redis://***@127.0.0.1:6390/0"),
    ("rediss://user:s3cret@localhost/2", "rediss://***@localhost/2"),
    ("redis://:p@ss@h:1/0", "redis://***@h:1/0"),  # an unescaped @ in the password: urlsplit takes the last
    ("redis://127.0.0.1:6379/0?password=s3cret", "redis://127.0.0.1:6379/0?password=***"),
    ("redis://h:1/0?db=2&password=s3cret&ssl_cert_reqs=none", "redis://h:1/0?db=2&password=***&ssl_cert_reqs=none"),
    ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
    ("postgresql://h/db?user=u&sslpassword=s3cret", "postgresql://h/db?user=u&sslpassword=***"),
    ("host=db user=airflow password=s3cret dbname=airflow", "host=db user=airflow password=*** dbname=airflow"),
    ("host=db password='s3 cret' dbname=airflow", "host=db password=*** dbname=airflow"),
    # each shape's value ends where its reader ends it: a query at &, ODBC at ; (braces may hold ;), libpq at
    # whitespace, a quoted value at its quote
    ("redis://h:1/0?password=ab;s3cret&db=2", "redis://h:1/0?password=***&db=2"),
    ("Server=db;Uid=sa;Pwd={ab;s3cret}}x};Database=d", "Server=db;Uid=sa;Pwd=***;Database=d"),
    ("host=db password=ab;s3cret,x dbname=airflow", "host=db password=*** dbname=airflow"),
    ("Pwd=ab s3cret;Server=db", "Pwd=***;Server=db"),
    ('{"password": "s3\\"cret", "host": "db"}', '{"password": ***, "host": "db"}'),
    ("Authorization: Bearer s3cret.x-y", "Authorization: Bearer ***"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://h:1/0?db=2", "redis://h:1/0?db=2"),
])
def test_redact_hides_every_kind_of_password(redact: object, url: str, shown: str) -> None:
    assert callable(redact)
    assert redact(url) == shown
    assert "s3cret" not in shown and "s3 cret" not in shown


def test_both_redactions_are_one_function() -> None:
    from nightshift.redaction import redact

    assert events.redact is redact and redis_io.redact is redact


def test_a_password_in_the_query_on_the_command_line_is_refused_without_showing_it() -> None:
    from nightshift.errors import UsageError

    with pytest.raises(UsageError, match="NIGHTSHIFT_EVENTS_REDIS_URL instead") as caught:
        events.redis_url("redis://127.0.0.1:6390/0?password=s3cret")
    assert "s3cret" not in str(caught.value)
