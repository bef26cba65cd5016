"""The shell blocks of the documentation pages, and a reader's shell that runs them.

The convention (docs/getting-started.md, "The commands on these pages"): a fenced block whose language is `bash` is
a command to run as written, in order, in one shell per page, from where the page says. Two classes mark the others,
in superfences' brace form (mkdocs.yml enables `attr_list`):

- ```` ```{ .bash .illustration } ```` shows a command's shape: a cluster, a registry, placeholders such as `DIR`.
  Not to be run as is; the site labels it.
- ```` ```{ .bash .server } ```` runs until stopped (a UI): a reader opens the URL it names
  (`http://127.0.0.1:PORT`), then stops it with Ctrl-C. A test starts it in the background, waits until the URL
  answers, and stops it by its process group.

Every fenced block names its language (`text` for output and diagrams); a shell block is spelled `bash`.
`run_page` runs a page's runnable blocks as one bash script in a process group of its own (`errexit`, `pipefail`),
each server block in a process group of its own inside it, and fails naming the page, the block (its line) and the
command that broke, with the output's tail.
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

RUNNABLE, ILLUSTRATION, SERVER = "runnable", "illustration", "server"
MARKERS = {"illustration": ILLUSTRATION, "server": SERVER}
SHELL = "bash"
# Other names of a shell language a page might use: refused, so that one spelling says "run me".
OTHER_SHELLS = frozenset({"sh", "shell", "console", "zsh", "shell-session", "sh-session", "terminal"})
SERVER_URL = re.compile(r"http://127\.0\.0\.1:\d+[^\s'\"]*")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*?)[ \t]*$")
HEADING = re.compile(r"^#{1,6} +(.*?)[ #]*$")
KILL_GRACE_S = 60  # run-mpijob removes its namespaces on SIGTERM: give it time on a loaded machine


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it starts (the fence's line, 1-based), its language and classes."""

    page: str
    line: int
    info: str
    language: str
    classes: tuple[str, ...]
    section: str
    text: str

    @property
    def kind(self) -> str | None:
        """runnable, illustration or server for a shell block; None for any other language."""
        if self.language != SHELL:
            return None
        marked = [MARKERS[name] for name in self.classes if name in MARKERS]
        return marked[0] if marked else RUNNABLE

    @property
    def where(self) -> str:
        return f"docs/{self.page}, the block at line {self.line}"

    def problem(self) -> str | None:
        """What is wrong with this block's marking (one line), or None."""
        if not self.language:
            return f"{self.where} names no language: write ```text for output or a diagram, ```bash for a command"
        if self.language in OTHER_SHELLS:
            return (f"{self.where} is ```{self.language}: a shell block is ```bash (runnable), "
                    "```{ .bash .illustration } or ```{ .bash .server }")
        if self.language != SHELL:
            return None
        unknown = [name for name in self.classes if name not in MARKERS]
        if unknown:
            return f"{self.where} has class(es) {unknown}: a shell block takes only .illustration or .server"
        if len(self.classes) > 1:
            return f"{self.where} is marked {list(self.classes)}: one of .illustration or .server"
        if self.kind == SERVER and not SERVER_URL.search(self.text):
            return f"{self.where} is a .server block naming no http://127.0.0.1:PORT URL for the reader to open"
        if self.kind == RUNNABLE and (re.search(r"\[--[^\]]*\]|<[A-Z_]+>", self.text) or _placeholders(self.text)):
            return (f"{self.where} is runnable but shows optional arguments or placeholders ([--x], <X>, "
                    "--data DIR, ...): put them in the prose, or mark the block .illustration")
        return None


def _placeholders(text: str) -> list[str]:
    """Words of a block that stand for something the reader fills in: `...`, or an option's value in capitals
    (`--data DIR`)."""
    found = []
    for words in simple_commands(text):
        for before, word in zip(["", *words], words, strict=False):
            if word == "..." or (before.startswith("--") and re.fullmatch(r"[A-Z][A-Z0-9_]+", word)):
                found.append(word)
    return found


def parse_info(info: str) -> tuple[str, tuple[str, ...]]:
    """The language and classes of a fence's info string: `bash`, or the brace form `{ .bash .illustration }`."""
    info = info.strip()
    if info.startswith("{") and info.endswith("}"):
        names = [word[1:] for word in info[1:-1].split() if word.startswith(".")]
        return (names[0], tuple(names[1:])) if names else ("", ())
    words = info.split()
    return (words[0], ()) if words else ("", ())


def blocks(page: str, markdown: str) -> list[Block]:
    """Every fenced block of `markdown` (the page `page`, relative to docs/), in order."""
    found: list[Block] = []
    lines = markdown.splitlines()
    section = ""
    i = 0
    while i < len(lines):
        heading = HEADING.match(lines[i])
        if heading:
            section = heading[1]
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        fence = opened["fence"]
        end = i + 1
        while end < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence)}{fence[0]}*[ \t]*$", lines[end]):
            end += 1
        language, classes = parse_info(opened["info"])
        body = textwrap.dedent("\n".join(lines[i + 1:end]))
        found.append(Block(page, i + 1, opened["info"], language, classes, section, body))
        i = end + 1
    return found


def page_blocks(page: str) -> list[Block]:
    return blocks(page, (DOCS / page).read_text())



# --- the commands of a block, read without running them -----------------------------------------------------


def _without_comments(text: str) -> str:
    """`text` less its shell comments (a `#` that starts a word outside quotes, to the end of its line)."""
    out: list[str] = []
    quote = ""
    i = 0
    while i < len(text):
        char = text[i]
        if quote:
            if char == quote:
                quote = ""
            elif char == "\\" and quote == '"':
                out.append(char)
                i += 1
                char = text[i] if i < len(text) else ""
        elif char in "'\"":
            quote = char
        elif char == "\\":
            out.append(char)
            i += 1
            char = text[i] if i < len(text) else ""
        elif char == "#" and (not out or out[-1] in " \t\n;&|("):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        out.append(char)
        i += 1
    return "".join(out)


def simple_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block as word lists (split at newlines and control operators, leading
    `NAME=value` assignments dropped); enough to find each `nightshift ...` a page shows and check its arguments."""
    lexer = shlex.shlex(_without_comments(text).replace("\\\n", " "), posix=True, punctuation_chars=";&|<>()\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    lexer.commenters = ""
    found: list[list[str]] = []
    words: list[str] = []
    for token in lexer:
        if token and set(token) <= set(";&|<>()\n"):
            if words:
                found.append(words)
            words = []
        elif words or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", token):
            words.append(token)
    if words:
        found.append(words)
    return found

# --- a reader's shell ----------------------------------------------------------------------------------------


class PageFailed(AssertionError):
    """A command of a documentation page did not run as written."""


@dataclass
class Reader:
    """Where a reader follows the pages: the folder they stand in, their environment, and a folder for the test's
    own files (the scripts, the output, the state of the shell)."""

    cwd: Path
    env: dict[str, str]
    state: Path
    outputs: dict[str, str] = field(default_factory=dict)


WAIT_FOR_URL = """\
import os, sys, time, urllib.request
url, pid, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            print(f"docs test: {url} answered {answer.status}", flush=True)
            break
    except OSError as err:
        why = err
    try:
        gone = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        gone = True
    if gone:
        sys.exit(f"docs test: the server block exited before {url} answered ({why})")
    if time.monotonic() > deadline:
        sys.exit(f"docs test: {url} did not answer in {sys.argv[3]} s ({why})")
    time.sleep(0.5)
"""


def _script(page: str, chosen: list[Block], texts: list[str], state: Path, server_wait_s: float
            ) -> tuple[str, list[tuple[int, int, Block, bool]]]:
    """The bash script of a page's blocks and the spans of its lines (first, last, block, whether they are the
    block's own lines or the test's around a server block)."""
    lines = [
        f"# docs/{page}: its runnable blocks, as a reader runs them (tests/docs_commands.py)",
        "set -o errexit -o pipefail",
        f"trap 'printf \"%s\\t%s\\n\" \"$LINENO\" \"$BASH_COMMAND\" > {state}/at' DEBUG",
        f"trap 'printf \"%s\\t%s\\t%s\\n\" \"$?\" \"$LINENO\" \"$BASH_COMMAND\" > {state}/failed' ERR",
    ]
    spans: list[tuple[int, int, Block, bool]] = []
    (state / "wait_for_url.py").write_text(WAIT_FOR_URL)
    for block, text in zip(chosen, texts, strict=True):
        lines.append(f"# {block.where}")
        body = text.splitlines()
        if block.kind == SERVER:
            url = SERVER_URL.search(text)
            assert url is not None  # Block.problem() refuses a server block without one
            lines += ["set -m", "("]
            spans.append((len(lines) + 1, len(lines) + len(body), block, True))
            lines += body
            harness = [") &", "__server=$!", "set +m", f"echo \"$__server\" >> {state}/servers",
                       f"{sys.executable} {state}/wait_for_url.py {url[0]} \"$__server\" {server_wait_s}",
                       "kill -TERM -- \"-$__server\"", "wait \"$__server\" || true"]
            spans.append((len(lines) + 1, len(lines) + len(harness), block, False))
            lines += harness
        else:
            spans.append((len(lines) + 1, len(lines) + len(body), block, True))
            lines += body
    return "\n".join(lines) + "\n", spans


def _children_cpu_s() -> float:
    """User and system CPU seconds of this process's waited-for children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies, which kill(2) still finds, do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _kill_group(pgid: int) -> None:
    """SIGTERM the process group, SIGKILL what is left of it after KILL_GRACE_S."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _failure(page: str, spans: list[tuple[int, int, Block, bool]], record: str, how: str) -> str:
    """`docs/PAGE, the block at line N: page line L: `COMMAND` HOW`, from a trap's record: `[status TAB] line TAB
    command`, the script's line that the page's line is found from."""
    fields = record.rstrip("\n").split("\t")
    if len(fields) == 3:
        status, lineno, command = fields
        how = f"exited {status}"
    elif len(fields) == 2:
        lineno, command = fields
    else:
        return f"docs/{page}: {how} (no command recorded)"
    at = int(lineno)
    for first, last, block, on_page in spans:
        if first <= at <= last and on_page:
            return f"{block.where}: page line {block.line + 1 + at - first}: `{command}` {how}"
        if first <= at <= last:
            return f"{block.where}, a server block: the test waiting for its URL {how} (why: the output's tail)"
    return f"docs/{page}: the test's own line {at} of the page's script (`{command}`) {how}"


def run_page(reader: Reader, page: str, *, only: list[Block] | None = None, replace: dict[str, str] | None = None,
             skip: dict[str, str] | None = None, cwd: Path | None = None, env: dict[str, str] | None = None,
             timeout_s: float = 600, server_wait_s: float | None = None, root: Path = DOCS) -> str:
    """Run the runnable and server blocks of `page` (under `root`; or `only` those) in order, in one fresh bash in
    `cwd` (else `reader.cwd`) with `env` (else `reader.env`); returns the output, raises PageFailed naming the page,
    block and command that broke.

    `timeout_s` guards against a page that hangs: the page's own waits follow readiness. A server block is waited
    for until its URL answers or it exits (at most `server_wait_s`, by default the page's `timeout_s`).

    `replace` {text: smaller}: a setting the test may run smaller, only where the page itself shows the smaller one.
    `skip` {line: why}: a runnable line the test does not run (the test suite itself), said in the output."""
    markdown = (root / page).read_text()
    chosen = [b for b in (only if only is not None else blocks(page, markdown)) if b.kind in (RUNNABLE, SERVER)]
    if not chosen:
        raise PageFailed(f"docs/{page} has no runnable block")
    texts = [b.text for b in chosen]
    prose = markdown.splitlines()  # the page less its runnable blocks: where a smaller setting must be shown
    for block in reversed(blocks(page, markdown)):
        if block.kind in (RUNNABLE, SERVER):
            prose[block.line - 1:block.line + len(block.text.splitlines()) + 1] = []
    for old, new in (replace or {}).items():
        hits = [i for i, text in enumerate(texts) if old in text]
        if not hits:
            raise PageFailed(f"docs/{page}: no runnable block shows `{old}` any more (the test runs it as `{new}`)")
        if new not in "\n".join(prose):
            raise PageFailed(f"docs/{page} does not show `{new}`, which the test runs instead of `{old}`: a page's "
                             "command may run smaller in the test only where the page says how")
        for i in hits:
            texts[i] = texts[i].replace(old, new)
    for line, why in (skip or {}).items():
        hits = [i for i, text in enumerate(texts) if line in text.splitlines()]
        if not hits:
            raise PageFailed(f"docs/{page}: no runnable block has the line `{line}` any more (skipped: {why})")
        for i in hits:
            texts[i] = "\n".join(f": 'not run by the docs test: {why}'" if row == line else row
                                 for row in texts[i].splitlines())
    state = reader.state / re.sub(r"[^A-Za-z0-9]+", "-", page)
    state.mkdir(parents=True, exist_ok=True)
    script, spans = _script(page, chosen, texts, state, timeout_s if server_wait_s is None else server_wait_s)
    (state / "page.sh").write_text(script)
    output = state / "output.log"
    started, cpu_before = time.monotonic(), _children_cpu_s()
    with output.open("w") as out:
        shell = subprocess.Popen(["bash", str(state / "page.sh")], cwd=cwd or reader.cwd, env=env or reader.env,
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            code: int | None = shell.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            servers = (state / "servers").read_text().split() if (state / "servers").exists() else []
            for pgid in [shell.pid, *map(int, servers)]:
                _kill_group(pgid)
            shell.wait()
    text = output.read_text(errors="replace")
    reader.outputs[page] = text
    tail = text[-4000:]
    if code is None:
        at = (state / "at").read_text() if (state / "at").exists() else ""
        raise PageFailed(_failure(page, spans, at, f"was still running after {timeout_s:.0f} s (page total)")
                         + f"\n--- output's tail ({state / 'output.log'}):\n{tail}")
    if code != 0:
        failed = (state / "failed").read_text() if (state / "failed").exists() else ""
        raise PageFailed(_failure(page, spans, failed, f"exited {code}")
                         + f"\n--- output's tail ({state / 'output.log'}):\n{tail}")
    print(f"docs/{page}: {len(chosen)} block(s) ran in {time.monotonic() - started:.0f} s "
          f"({_children_cpu_s() - cpu_before:.0f} s CPU of the processes the page's shell waited for)")
    return text
