"""Every shell block of the documentation is a command to run as written, or marked as something else
(tests/docs_commands.py has the convention and the runner; no test runs the pages' blocks end to end yet: that
integration module is in history, ff0fd8c^, until it passes in a full CI run).

Here, without running the pages: every block's marking, the shell syntax of each runnable block, the arguments of
each `nightshift` command they show against the CLI's own parsers, and the runner itself on small pages of its own:
a failure names the page, the block and the command; a server block is started, waited for and stopped.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import gen_reference
from tests.docs_commands import (
    DOCS,
    ILLUSTRATION,
    RUNNABLE,
    SERVER,
    Block,
    PageFailed,
    Reader,
    blocks,
    page_blocks,
    run_page,
    simple_commands,
)


@pytest.fixture(scope="module")
def every_block() -> list[Block]:
    """The blocks of every page of docs/ (the generated reference pages: below)."""
    return [b for page in sorted(DOCS.rglob("*.md")) for b in page_blocks(str(page.relative_to(DOCS)))]


def test_every_shell_block_is_runnable_or_marked(every_block: list[Block]) -> None:
    problems = [problem for block in every_block if (problem := block.problem())]
    assert not problems, "\n".join(problems)
    kinds = {block.kind for block in every_block}
    assert {RUNNABLE, ILLUSTRATION, SERVER} <= kinds
    # the four pages the integration test runs have runnable blocks
    for page in ("getting-started.md", "how-to/emulated-hosts.md", "how-to/streams.md", "how-to/model-search.md"):
        assert any(b.kind == RUNNABLE for b in page_blocks(page)), page


@pytest.mark.slow
def test_the_generated_reference_pages_mark_their_blocks_too() -> None:
    found = [b for page, markdown in gen_reference.pages().items() for b in blocks(page, markdown)]
    assert found and not [problem for block in found if (problem := block.problem())]


@pytest.mark.parametrize(("info", "wrong"), [
    ("", "names no language"),
    ("sh", "a shell block is ```bash"),
    ("console", "a shell block is ```bash"),
    ("{ .bash .example }", "takes only .illustration or .server"),
    ("{ .bash .illustration .server }", "one of .illustration or .server"),
])
def test_a_wrong_marking_is_named(info: str, wrong: str) -> None:
    [block] = blocks("x.md", f"# X\n\n```{info}\nnightshift plan\n```\n")
    problem = block.problem()
    assert problem is not None and wrong in problem and "docs/x.md, the block at line 3" in problem


def test_a_runnable_block_with_placeholders_or_a_server_without_its_url_is_refused() -> None:
    optional, placeholder, capitals, dots, server, fine = blocks("x.md", (
        "```bash\nnightshift search --data d [--pruner asha|hyperband|none]\n```\n"
        "```bash\nnightshift stage <DATA>\n```\n"
        "```bash\npython -m nightshift.train --data DIR --epochs 1\nredis-cli -p 6390 XADD s '*' data 1\n```\n"
        "```bash\npython -m nightshift.train --model my_net ...\n```\n"
        "```{ .bash .server }\nmlflow ui --port 5001\n```\n"
        "```{ .bash .server }\nmlflow ui --port 5001   # open http://127.0.0.1:5001\n```\n"))
    assert "optional arguments or placeholders" in str(optional.problem())
    assert "optional arguments or placeholders" in str(placeholder.problem())
    assert "optional arguments or placeholders" in str(capitals.problem())
    assert "optional arguments or placeholders" in str(dots.problem())
    assert blocks("x.md", "```bash\nredis-cli -p 6390 XADD s '*' data 1\n```\n")[0].problem() is None
    assert "naming no http://127.0.0.1:PORT URL" in str(server.problem())
    assert fine.problem() is None and fine.kind == SERVER


def test_blocks_keep_indentation_sections_and_lines() -> None:
    markdown = ("# A\n\n!!! note\n    ```bash\n    export X=1\n    ```\n\n"
                "## B\n\n```{ .bash .illustration }\nkubectl get pods\n```\n")
    first, second = blocks("p.md", markdown)
    assert (first.line, first.text, first.section, first.kind) == (4, "export X=1", "A", RUNNABLE)
    assert (second.line, second.section, second.kind) == (10, "B", ILLUSTRATION)


def test_every_runnable_block_is_valid_bash(every_block: list[Block]) -> None:
    for block in every_block:
        if block.kind in (RUNNABLE, SERVER):
            done = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, check=False)
            assert done.returncode == 0, f"{block.where}: {done.stderr}"


def test_every_nightshift_command_a_runnable_block_shows_parses(every_block: list[Block]) -> None:
    """The CLI's own parsers read each `nightshift ...` of a runnable block: a flag that does not exist, a value of
    the wrong form (`--conf` not JSON), a missing argument fail here, naming the block."""
    from nightshift.cli import build_parser

    checked = 0
    for block in every_block:
        if block.kind not in (RUNNABLE, SERVER):
            continue
        for words in simple_commands(block.text):
            if words[0] != "nightshift":
                continue
            errors = io.StringIO()
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                try:
                    build_parser().parse_args(words[1:])
                except SystemExit as exit_:
                    assert exit_.code == 0, f"{block.where}: `{' '.join(words)}`: {errors.getvalue().strip()}"
            checked += 1
    assert checked >= 10


def test_simple_commands_split_a_block_as_bash_does() -> None:
    text = ("export A=$(mktemp -d) B=2   # the pods' home\n"
            "X=1 nightshift search --data d \\\n    --space '{\"lr\": 1,\n  \"m\": 2}' > out.json  # it's JSON\n"
            "kill %2; wait %2\n")
    assert simple_commands(text) == [
        ["export", "A=$"], ["mktemp", "-d"],
        ["nightshift", "search", "--data", "d", "--space", '{"lr": 1,\n  "m": 2}'], ["out.json"],
        ["kill", "%2"], ["wait", "%2"]]


# --- the runner, on pages of its own ----------------------------------------------------------------------


@pytest.fixture
def reader(tmp_path: Path) -> Reader:
    work = tmp_path / "work"
    work.mkdir()
    return Reader(work, {**os.environ, "TMPDIR": str(tmp_path)}, tmp_path / "state")


def write_page(root: Path, text: str) -> str:
    (root / "how-to").mkdir(parents=True, exist_ok=True)
    (root / "how-to" / "p.md").write_text(text)
    return "how-to/p.md"


@pytest.mark.slow
def test_a_failing_command_is_named_with_its_page_block_and_line(reader: Reader, tmp_path: Path) -> None:
    page = write_page(tmp_path, "# P\n\n```bash\necho one\n```\n\nText.\n\n```bash\necho two > two.txt\n"
                                "ls no-such-file \\\n   -l\necho never\n```\n")
    with pytest.raises(PageFailed) as failed:
        run_page(reader, page, root=tmp_path)
    message = str(failed.value)
    assert message.startswith("docs/how-to/p.md, the block at line 9: page line 11: `ls no-such-file -l` exited 2")
    assert "one\n" in message and "never" not in message  # the output's tail, up to the failure
    assert (reader.cwd / "two.txt").read_text() == "two\n"  # run in the reader's folder


@pytest.mark.slow
def test_a_smaller_setting_needs_the_page_to_show_it_and_a_skipped_line_is_said(reader: Reader, tmp_path: Path
                                                                                ) -> None:
    page = write_page(tmp_path, "# P\n\n```bash\necho --trials 16\nmake test\n```\n\n`--trials 2` is quicker.\n")
    out = run_page(reader, page, root=tmp_path, replace={"--trials 16": "--trials 2"},
                   skip={"make test": "the suite itself"})
    assert "--trials 2\n" in out
    with pytest.raises(PageFailed, match="does not show `--trials 1`"):
        run_page(reader, page, root=tmp_path, replace={"--trials 16": "--trials 1"})
    with pytest.raises(PageFailed, match="no runnable block shows `--trials 9`"):
        run_page(reader, page, root=tmp_path, replace={"--trials 9": "--trials 2"})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_a_server_block_is_waited_for_then_stopped_with_its_process_group(reader: Reader, tmp_path: Path) -> None:
    port = free_port()
    page = write_page(tmp_path, (
        "# P\n\n```bash\nmkdir -p site && echo hello > site/index.html\n```\n\n"
        f"```{{ .bash .server }}\nbash -c 'echo $$ > server.pid; exec {sys.executable} -m http.server "
        f"--bind 127.0.0.1 --directory site {port}'   # open http://127.0.0.1:{port}/\n```\n\n"
        "```bash\necho after the server\n```\n"))
    out = run_page(reader, page, root=tmp_path)
    assert f"http://127.0.0.1:{port}/ answered 200" in out and "after the server" in out
    pid = int((reader.cwd / "server.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
def test_a_server_that_exits_or_a_page_that_hangs_fails_naming_the_block(reader: Reader, tmp_path: Path) -> None:
    page = write_page(tmp_path, "# P\n\n```{ .bash .server }\nfalse   # http://127.0.0.1:9/\n```\n")
    with pytest.raises(PageFailed, match=re.escape("the server block exited before http://127.0.0.1:9/ answered")):
        run_page(reader, page, root=tmp_path)
    page = write_page(tmp_path, "# P\n\n```bash\necho start\nsleep 60 &\nsleep 30\n```\n")
    with pytest.raises(PageFailed, match=r"line 6: `sleep 30` was still running after 2 s") as failed:
        run_page(reader, page, root=tmp_path, timeout_s=2)
    assert "start" in str(failed.value)
