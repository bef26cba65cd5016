"""Where secrets hide in configuration text, and that text with them hidden (standard library only).

A secret shows up in these shapes: a URL's userinfo (`redis://user:pw@host`), a URL's query parameter
(`redis://host/0?password=pw`, `...?X-Amz-Signature=...`, `?%70assword=pw`: names are URL-decoded, as
redis-py's parse_url does), a key=value DSN (`host=db password=pw`, `Server=db;Pwd={p;w};`), a `key: value`
pair (JSON, YAML, headers: `{"password": "pw"}`, `password: pw`), an option (`--db-password pw`), and an HTTP
credential (`Bearer tok`, `Basic dXNlcjpwdw==`). `redact` hides them for messages and logs; `carries_secret`
says whether a value holds one (what must not reach a child process); `secret_name` says whether a name (an
environment variable, a query parameter, a DSN key) announces one.

Each shape's value ends where its own reader ends it, so no part of a password shows: a query value at `&`
or `#` (parse_qs splits on `&` only, so `;` belongs to the value), an ODBC value at `;` (braced `{...}` may hold
`;`), a libpq or option value at whitespace (libpq reads `;`, `,`, `&`, `#` as part of it; a pair that could
be either libpq's or a first ODBC pair is hidden to the later of whitespace and `;`), a quoted value at its
closing quote, and an unquoted `key: value` at the end of the line.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

# A name holding one of these anywhere names a secret (AWS_SECRET_ACCESS_KEY, X-Amz-Credential, sslpassword).
SECRET_NAME_PARTS = ("SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "PRIVATE", "SIGNATURE",
                     "API_KEY", "ACCESS_KEY")
# ... a name with one of these as a whole word, or a word ending in TOKEN (HF_TOKEN, accessToken; not
# MAX_TOKENS or TOKENIZER), anywhere (NIGHTSHIFT_GITHUB_PAT, NIGHTSHIFT_JWT_FILE, HOROVOD_PW) ...
SECRET_WORDS = frozenset({"TOKEN", "PAT", "JWT", "CRED", "CREDS", "HMAC", "BEARER", "PW"})
# ... and a name whose last word is one of these, or ends in KEY (NIGHTSHIFT_SIGNING_KEY, REDIS_PASS, Pwd, sig).
SECRET_LAST_WORDS = frozenset({"KEY", "KEYS", "PASS", "PWD", "SIG", "AUTH"})
# Names that read like a secret and are not: NCCL's InfiniBand partition key (a number such as 0x8001).
NOT_SECRET_NAMES = frozenset({"NCCL_IB_PKEY"})
# The userinfo of a URL: everything between `scheme://` and the last `@` before whitespace or a quote. Wider
# than urlsplit's (which ends it at the path's `/`, `?` or `#`): a password with an unencoded `/`, `?` or `#`
# is still a password to whoever wrote it, and hiding an `@` in a path as well costs nothing.
USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s\"'<>]*)@")
# A name that may start a pair: at the start, or after a separator, an opening bracket or a quote. Then an
# optional closing quote (JSON/YAML keys), then `=` or `:` (or, for a `--option`, whitespace).
KEY = re.compile(r"(?:^|(?<=[\s?&;,({\[\"'-]))(?P<key>[A-Za-z_%][A-Za-z0-9_.%-]*)(?P<quote>[\"']?)"
                 r"(?P<sep>[ \t]*[=:][ \t]*|[ \t]+)")
# HTTP credentials (Authorization headers): the scheme is case-insensitive; Basic only as HTTP spells it.
CREDENTIAL = re.compile(r"(?:(?i:\bbearer)|\bBasic)[ \t]+(?P<value>[A-Za-z0-9._~+/=-]+)")
MASK = "***"


def secret_name(name: str) -> bool:
    """Whether `name` (an environment variable, query parameter or DSN key) says it holds a secret."""
    name = unquote(name)
    upper = re.sub(r"[-.\s]", "_", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)).upper()
    if upper in NOT_SECRET_NAMES:
        return False
    words = [word for word in upper.split("_") if word]
    last = words[-1] if words else ""
    return (any(part in upper for part in SECRET_NAME_PARTS)
            or any(word in SECRET_WORDS or word.endswith("TOKEN") for word in words)
            or last in SECRET_LAST_WORDS or last.endswith("KEY"))


def _quoted_end(text: str, start: int) -> int:
    """The end of the quoted value at `start` (after its closing quote; backslash escapes), or of the text."""
    quote, i = text[start], start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == quote:
            return i + 1
        else:
            i += 1
    return len(text)


def _braced_end(text: str, start: int) -> int:
    """The end of an ODBC braced value at `start` (`}}` is an escaped brace), or of the text."""
    i = start + 1
    while i < len(text):
        if text[i] == "}":
            if text[i + 1:i + 2] == "}":
                i += 2
                continue
            return i + 1
        i += 1
    return len(text)


def _value_end(text: str, start: int, stops: str) -> int:
    end = start
    while end < len(text) and text[end] not in stops:
        end += 1
    return end


def _secret_spans(text: str) -> list[tuple[int, int]]:
    """The (start, end) of every secret value in `text`: pairs whose name says secret, and HTTP credentials."""
    spans: list[tuple[int, int]] = []
    pos = 0
    while (match := KEY.search(text, pos)) is not None:
        start = match.start("key")
        before = text[start - 1] if start else ""
        option = text[max(0, start - 2):start] == "--"
        sep = match["sep"].strip()
        if not sep and not option:  # `word word`: not a pair, look again from the next word
            pos = match.end("key")
            continue
        v = match.end()
        if v >= len(text) or (not sep and text[v] == "-"):
            pos = max(v, match.end("key"))
            continue
        if text[v] in "'\"":
            end = _quoted_end(text, v)
        elif text[v] == "{" and sep == "=":
            end = _braced_end(text, v)
        elif before and before in "?&" and sep == "=":
            end = _value_end(text, v, "&# \t\r\n")  # a URL query: parse_qs splits on & only
        elif before == ";" and sep == "=":
            end = _value_end(text, v, ";\r\n")  # ODBC: an unbraced value runs to ;
        elif sep == ":":
            end = _value_end(text, v, "\r\n")  # YAML, a header, unquoted JSON: the rest of the line
        elif sep == "=":  # libpq (to whitespace) or a first ODBC pair (to ;): whichever reading hides more
            end = _value_end(text, v, " \t\r\n")
            odbc = _value_end(text, v, ";\r\n")
            if text[odbc:odbc + 1] == ";":
                end = max(end, odbc)
        else:
            end = _value_end(text, v, " \t\r\n")  # an option's value: to whitespace
        if end > v and secret_name(match["key"]):
            spans.append((v, end))
            pos = end
        else:
            pos = match.end("key")
    spans.extend(m.span("value") for m in CREDENTIAL.finditer(text)
                 if not any(s <= m.start("value") < e for s, e in spans))
    return sorted(spans)


def carries_secret(value: str) -> bool:
    """Whether `value` holds a URL with a password, a pair (query parameter, DSN, `key: value`, `--option`)
    whose name says secret, or an HTTP credential."""
    for match in USERINFO.finditer(value):
        _user, colon, password = match["userinfo"].partition(":")
        if colon and password:
            return True
    return bool(_secret_spans(value))


def redact(text: str) -> str:
    """`text` (a URL, DSN, header or config blob) with every secret in it replaced by ***: a URL's user and
    password, the whole value of each pair whose name says it is a secret, HTTP credentials. Everything else
    is kept."""
    text = USERINFO.sub(lambda match: f"{match['scheme']}{MASK}@", text)
    for start, end in reversed(_secret_spans(text)):
        text = f"{text[:start]}{MASK}{text[end:]}"
    return text
