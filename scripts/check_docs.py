"""Run every command block of README.md and docs/*.md in a fresh clone, as a reader would.

What it checks: the project rule "every command block in the README and docs runs as written
in a fresh clone". It clones the checkout's committed HEAD into a temporary folder and runs,
with cwd = the clone, in document order (README.md first, then docs/*.md by name; state carries
from one block to the next within a file, e.g. /tmp/ckpt written by one block and trained from
by the next):

- ```bash blocks: every line that is not blank or a comment is a command (a line ending in a
  backslash continues on the next). It passes when it exits 0. A block whose commands include
  `pip install` sets up an environment (checked by .ci/run and tests/distributed/test_install.py)
  and is skipped.
- ```console blocks: a line starting with `$ ` is a command; the lines after it, up to the next
  `$ `, are its expected output. Each non-empty expected line, whitespace collapsed, must appear
  in one line of the command's stdout+stderr; `...` inside it matches anything. The exit status
  does not matter when output is expected (an error shown is an error expected); a command with
  no expected output must exit 0.

Blocks tagged text, python, yaml, json or untagged are templates, outputs or code: not run.
Commands run with `bash -c` in the current Python environment, with PYTHONPATH=<clone> (so
`mmpipe` and `python -m mmpipe` import the clone's package; checked before the first command)
and MMPIPE_CHECK_DOCS=1, 600 s each. Run outputs (Hydra's outputs/<date>/<time>, runs/...)
land in the clone, which is deleted at the end unless --keep.

Usage (from the repository root; the whole set takes 8 to 10 minutes on 2 CPU cores):

    python scripts/check_docs.py [CHECKOUT] [--only README.md] [--list] [--keep]

Prints one line per command (file:line, PASS/FAIL/SKIP, seconds, command; the last 15 lines
of output for a failure) and a summary; exits 1 if any command failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RUN_TAGS = ("bash", "console")
TIMEOUT_S = 600
TAIL_LINES = 15
SKIP_MARK = "pip install"
"""A bash block with this in a command sets up an environment: skipped, not run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Command:
    """One command of a doc block, with where it is written and what it must print."""

    file: str
    """The document's path relative to the checkout (README.md, docs/data.md)."""
    line: int
    """The 1-based line of the command's first line in the document."""
    text: str
    """The command as bash receives it (continuation lines joined)."""
    expected: tuple[str, ...]
    """Lines its output must contain (console blocks); empty for bash blocks."""
    console: bool
    """True for a ```console command (passes on matching output, whatever its exit status)."""
    skip: str
    """Why the command is not run ('' when it is run)."""


def doc_files(root: Path) -> list[Path]:
    """README.md, then docs/*.md in name order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def parse_blocks(path: Path, rel: str) -> list[Command]:
    """The commands of the bash and console blocks of one markdown file, in document order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    commands: list[Command] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*```\s*(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        tag, start = fence.group(1), i + 1
        end = start
        while end < len(lines) and not lines[end].lstrip().startswith("```"):
            end += 1
        if tag == "bash":
            commands += bash_commands(lines[start:end], rel, start + 1)
        elif tag == "console":
            commands += console_commands(lines[start:end], rel, start + 1)
        i = end + 1
    return commands


def bash_commands(body: list[str], rel: str, first_line: int) -> list[Command]:
    """Every non-comment line is a command; a trailing backslash joins the next line."""
    found: list[tuple[int, str]] = []
    pending: list[str] = []
    pending_line = 0
    for n, raw in enumerate(body, first_line):
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            pending_line = n
        if line.endswith("\\"):
            pending.append(line[:-1].rstrip())
            continue
        pending.append(line)
        found.append((pending_line, " ".join(p.strip() for p in pending)))
        pending = []
    if pending:
        found.append((pending_line, " ".join(p.strip() for p in pending)))
    setup = any(SKIP_MARK in t for _, t in found)
    skip = "set-up (pip install): run by .ci/run and tests/distributed/test_install.py" if setup else ""
    return [Command(file=rel, line=n, text=t, expected=(), console=False, skip=skip) for n, t in found]


def console_commands(body: list[str], rel: str, first_line: int) -> list[Command]:
    """`$ ` lines are commands; the lines up to the next `$ ` are their expected output."""
    commands: list[Command] = []
    current: tuple[int, str] | None = None
    expected: list[str] = []

    def close() -> None:
        if current is not None:
            commands.append(Command(file=rel, line=current[0], text=current[1],
                                    expected=tuple(expected), console=True, skip=""))

    for n, raw in enumerate(body, first_line):
        if raw.startswith("$ "):
            close()
            current, expected = (n, raw[2:].strip()), []
        elif raw.strip() and current is not None:
            expected.append(raw)
    close()
    return commands


def collapse(text: str) -> str:
    """Runs of whitespace as one space, no leading or trailing space."""
    return " ".join(text.split())


def missing_lines(expected: tuple[str, ...], output: str) -> list[str]:
    """The expected lines that no output line contains (`...` is a wildcard)."""
    out_lines = [collapse(line) for line in output.splitlines()]
    missing = []
    for want in expected:
        pattern = re.compile(".*?".join(re.escape(part) for part in collapse(want).split("...")))
        if not any(pattern.search(line) for line in out_lines):
            missing.append(want)
    return missing


def clone_head(checkout: Path, into: Path) -> Path:
    """A fresh clone of the checkout's committed HEAD (works for git worktrees too)."""
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    clone = into / "mmpipe-clone"
    subprocess.run(["git", "clone", "--quiet", str(checkout), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", head], check=True)
    return clone


def run_env(clone: Path) -> dict[str, str]:
    """This Python environment first on PATH, the clone's package first on the import path."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(clone), env.get("PYTHONPATH", "")) if p)
    env["MMPIPE_CHECK_DOCS"] = "1"
    return env


def check_imports(clone: Path, env: dict[str, str]) -> None:
    """Fail unless both `python` and the `mmpipe` script's interpreter import the clone's mmpipe.

    Run from / so that only PYTHONPATH (not the working directory) can put the clone first, as
    for the `mmpipe` console script, whose sys.path[0] is its bin folder.
    """
    probe = "import mmpipe, pathlib; print(pathlib.Path(mmpipe.__file__).resolve().parent.parent)"
    interpreters = [["python"]]
    script = shutil.which("mmpipe", path=env["PATH"])
    if script:
        shebang = Path(script).read_text(encoding="utf-8", errors="replace").splitlines()[0]
        interpreters.append(shlex.split(shebang[2:]) if shebang.startswith("#!") else ["python"])
    for python in interpreters:
        got = subprocess.run([*python, "-c", probe], cwd="/", env=env, capture_output=True, text=True)
        if got.returncode != 0 or Path(got.stdout.strip()) != clone.resolve():
            sys.exit(f"check_docs: {' '.join(python)} imports mmpipe from "
                     f"{got.stdout.strip() or got.stderr.strip()}, not the clone {clone}")


def run_command(cmd: Command, clone: Path, env: dict[str, str]) -> tuple[bool, float, str]:
    """Run one command; (passed, seconds, the reason and output tail when it failed)."""
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", cmd.text], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            errors="replace", start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
        status = f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        # The command's own children (mmpipe's ranks) are in its session: stop them all.
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = f"timed out after {TIMEOUT_S} s"
    except BaseException:  # Ctrl-C: the command's own session does not get it, so stop it here
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    seconds = time.monotonic() - start
    tail = "\n".join("    | " + line for line in output.splitlines()[-TAIL_LINES:])
    if cmd.expected:
        missing = missing_lines(cmd.expected, output)
        if not missing and "timed out" not in status:
            return True, seconds, ""
        reason = f"{status}; expected output not found:\n" + "\n".join(f"    > {m}" for m in missing)
        return False, seconds, f"{reason}\n{tail}"
    if proc.returncode == 0:
        return True, seconds, ""
    return False, seconds, f"{status}\n{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the git checkout whose docs to check (default: this repository)")
    parser.add_argument("--only", action="append", metavar="FILE",
                        help="check only this document (e.g. README.md, docs/data.md); repeatable")
    parser.add_argument("--list", action="store_true", help="list the commands, run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    args = parser.parse_args()
    checkout: Path = args.checkout.resolve()

    files = doc_files(checkout)
    if args.only:
        wanted = {(checkout / f).resolve() for f in args.only}
        unknown = wanted - {f.resolve() for f in files}
        if unknown:
            parser.error(f"--only: not a checked document: {', '.join(map(str, sorted(unknown)))}")
        files = [f for f in files if f.resolve() in wanted]
    commands = [c for f in files for c in parse_blocks(f, str(f.relative_to(checkout)))]

    if args.list:
        for c in commands:
            print(f"{c.file}:{c.line} {'SKIP ' if c.skip else ''}{'$ ' if c.console else ''}{c.text}")
        return 0

    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--", *map(str, files)],
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        print(f"check_docs: warning: uncommitted changes; the clone runs HEAD:\n{dirty}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="check_docs-"))
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    begin = time.monotonic()
    try:
        clone = clone_head(checkout, tmp)
        env = run_env(clone)
        check_imports(clone, env)
        print(f"check_docs: {len(commands)} commands in {clone}", flush=True)
        for c in commands:
            if c.skip:
                counts["SKIP"] += 1
                print(f"{c.file}:{c.line} SKIP {0:.1f}s {c.text}  ({c.skip})", flush=True)
                continue
            passed, seconds, detail = run_command(c, clone, env)
            verdict = "PASS" if passed else "FAIL"
            counts[verdict] += 1
            print(f"{c.file}:{c.line} {verdict} {seconds:.1f}s {c.text}", flush=True)
            if detail:
                print(detail, flush=True)
    finally:
        if args.keep:
            print(f"check_docs: clone kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    total = time.monotonic() - begin
    print(f"check_docs: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {total:.0f} s")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
