"""Fuzzing ``dp-budget``: every subcommand and option of :func:`build_parser`, driven in-process
with nasty values against a seeded SQLite ledger (a fresh copy per example).

The property (issue 15, "Every bad input gets a clear error"): the exit code is 0, 1 or 2 and
nothing escapes ``main``; stderr carries at most one ``dp-budget...: error:`` line (argparse's
usage lines before it allowed, exit 2), no traceback and not the ledger file's path (the tests
pass the URL through ``DP_BUDGET_URL``, so no argument names it); a raw database error is a
finding (exit 1 is for ledger refusals only).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.cli import main
from dp_budget_provider.cli.parser import build_parser
from dp_budget_provider.cli.target import URL_ENV
from dp_budget_provider.ledger import BudgetCap, Policy, key_for
from dp_budget_provider.ledger.storage import history
from tests.admin import AdminLedger, admin_key_file
from tests.ledger_time import ledger_time_in

CLOSED = "2020-w01"

# Values that reach the edges of every argument type: numbers that overflow, vanish or are
# not numbers, ISO times at and beyond the ends of datetime, durations past a timedelta,
# control and invisible characters (U+200B, U+034F, U+FE0F), very long strings.
NASTY = [
    "",
    " ",
    "0",
    "-0",
    "-1",
    "1",
    "0.5",
    "1.5",
    "+5",
    " 7 ",
    "1_000",
    "0x10",
    "\u0661\u0662",  # Arabic-Indic digits: int() takes them
    "1e30",
    "-1e30",
    "1e308",
    "1e309",
    "1e-320",
    "nan",
    "NaN",
    "inf",
    "-inf",
    str(2**53 + 1),
    str(2**63 - 1),
    str(2**63),
    str(2**64),
    "9" * 400,
    "4294967296",
    "99999999999999",
    str(86399999913600),  # the seconds a timedelta holds
    str(86399999913601),
    "\x00",
    "a\x00b",
    "a\nb",
    "\t",
    "\x1b[31m",
    "a\u200bb",
    "\u200b",
    "a\u034fb",
    "\u034f",
    "a\ufe0f",
    "\ufe0f",
    "\u202e",
    "\ud800",  # a lone surrogate (what a shell passes for undecodable bytes)
    "аlice",  # Cyrillic a + Latin
    "x" * 300,
    "y" * 60_000,
    "0s",
    "1s",
    "30m",
    "1d",
    "1.5h",
    "1h30m",
    "99999999999999d",
    "9" * 30 + "w",
    "1e3d",
    "0001-01-01T00:00:00Z",
    "0001-01-01",
    "9999-12-31",
    "9999-12-31T23:59:59Z",
    "9999-12-31T23:59:59-14:00",
    "2026-07-14T12:00:00Z",
    "2026-07-14T12:00:00+25:00",
    "2026-13-45",
    "2026-02-30T00:00:00",
    "yesterday",
    CLOSED,
    "2026-w28",
    "9999-w52",
    "9999-12",
    "0000-w01",
    "2026-w99",
    "fixed:1:2",
    "alice",
    "heatmap",
    "default",
    "acme",
    "*",
    "iso_week",
    "month",
    "day",
    "fixed",
    "md",
    "json",
    "improved",
    "classic",
    "GDPR Art. 25",
    "--",
    "-",
    "--json",
    ".",
    "/",
    "missing/folder/file",
]

# Random text and numbers besides the list.
RANDOM = st.one_of(
    st.text(max_size=20),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
NASTY_VALUE = st.one_of(st.sampled_from(NASTY), st.sampled_from(NASTY), RANDOM)

# Good values per argument type, so that most commands get past argparse with one or two
# nasty values and carry them into the ledger.
GOOD_BY_TYPE = {
    "_positive": ["1", "0.5", "3", "2.5"],
    "_number": ["0.5", "0.9", "1e-5"],
    "_fraction": ["0.5", "0.8", "1"],
    "_count": ["0", "1", "2", "10", "3600", "86400"],
    "_seconds": ["3600", "86400", "604800"],
    "parse_duration": ["0s", "1d", "30m", "1h30m", "3d"],
}
GOOD_BY_DEST = {
    "delta": ["1e-5"],
    "window": [CLOSED, "2026-w28", "2020-w02"],
    "tenant": ["default", "acme", "*"],
    "query_type": ["heatmap", "count", "*"],
    "subject": ["alice", "bob", "dave"],
    "checkpoint": ["checkpoints.jsonl"],
}
# Edges per argument type: a nasty value is one of these half of the time.
_NUMBERS = ["-1", "0", "-0", "1e-320", "1e308", "1e309", "nan", "inf", "-inf", "1" * 400]
_WHOLE = ["-1", "0", str(2**53 + 1), "4294967296", "99999999999999", str(86399999913600)]
_WHOLE += [str(86399999913601), str(2**63 - 1), str(2**63), "1e30", "1.0", "\u0661"]
EDGES_BY_TYPE = {
    "_positive": _NUMBERS,
    "_number": _NUMBERS,
    "_fraction": [*_NUMBERS, "1", "1.0000001", "1e-300"],
    "_count": _WHOLE,
    "_seconds": _WHOLE,
    "parse_duration": ["0s", "99999999999999d", "999999999d", "1000000000d", "1e3d", "0.0000001s"],
}
URLS = [
    "",
    "nonsense",
    "sqlite://",
    "sqlite:///missing/folder/ledger.db",
    "sqlite:///a\x00b.db",
    "sqlite:///" + "z" * 5000,
    "mysql://user@localhost/db",
    "postgresql+asyncpg://user@localhost/db",
    "sqlite:///:memory:",
]


@dataclass(frozen=True)
class Option:
    name: str  # the longest option string ("" for a positional)
    takes_value: bool
    good: tuple[str, ...]
    edges: tuple[str, ...] = ()


@dataclass(frozen=True)
class Command:
    """A leaf subcommand: the words that name it, its options and positionals."""

    words: tuple[str, ...]
    options: tuple[Option, ...]
    required: frozenset[str]
    positionals: tuple[Option, ...]
    exclusive: tuple[tuple[str, ...], ...]


@pytest.fixture(autouse=True)
def administrator(monkeypatch):
    """The shell these tests run in is an administrator's: it holds the admin key."""
    monkeypatch.setenv("DP_BUDGET_ADMIN_KEY_FILE", str(admin_key_file()))


def _good(action: argparse.Action) -> tuple[str, ...]:
    if action.choices:
        return tuple(action.choices)
    kind = getattr(action.type, "__name__", None)
    return tuple(GOOD_BY_TYPE.get(kind) or GOOD_BY_DEST.get(action.dest) or ["note", "x y"])


def _edges(action: argparse.Action) -> tuple[str, ...]:
    kind = getattr(action.type, "__name__", None)
    return tuple(EDGES_BY_TYPE.get(kind, ["x" * 257, "\u200b", "\ud800", "9999-12-31"]))


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> Iterator[Command]:
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if subparsers:
        for name, sub in subparsers[0].choices.items():
            yield from _commands(sub, (*words, name))
        return
    options, required, positionals = [], set(), []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or "--url" in action.option_strings:
            continue
        if not action.option_strings:
            positionals.append(Option("", True, _good(action), _edges(action)))
            continue
        name = max(action.option_strings, key=len)
        options.append(Option(name, action.nargs != 0, _good(action), _edges(action)))
        if action.required:
            required.add(name)
    exclusive = tuple(
        tuple(max(a.option_strings, key=len) for a in group._group_actions)
        for group in parser._mutually_exclusive_groups
    )
    yield Command(words, tuple(options), frozenset(required), tuple(positionals), exclusive)


COMMANDS = list(_commands(build_parser()))


@st.composite
def argvs(draw: st.DrawFn, command: Command) -> list[str]:
    """One line of ``command``: every value good but one (now and then two) nasty ones, so
    that most lines get past argparse and carry a bad value into the ledger."""
    slots = len(command.positionals) + len(command.options)
    bad = {draw(st.integers(0, max(slots - 1, 0)))}
    if draw(st.integers(0, 3)) == 0:
        bad.add(draw(st.integers(0, max(slots - 1, 0))))

    def value(option: Option, index: int) -> str:
        if index in bad:
            return draw(st.one_of(st.sampled_from(option.edges), NASTY_VALUE))
        return draw(st.sampled_from(option.good))

    argv = list(command.words)
    argv += [value(positional, i) for i, positional in enumerate(command.positionals)]
    exclusive = {name for group in command.exclusive for name in group}
    chosen_exclusive = {
        draw(st.sampled_from(group)) for group in command.exclusive if draw(st.integers(0, 5))
    }
    for index, option in enumerate(command.options, start=len(command.positionals)):
        name = option.name
        if name in exclusive and name not in chosen_exclusive:
            continue
        optional = name not in command.required and name not in chosen_exclusive
        if optional and index not in bad and draw(st.booleans()):
            continue  # the bad value's option is always given
        if not option.takes_value:
            argv.append(name)
        elif draw(st.booleans()):
            argv.append(f"{name}={value(option, index)}")
        else:
            argv += [name, value(option, index)]
    if draw(st.integers(0, 14)) == 0:  # now and then another ledger URL
        argv += ["--url", draw(st.sampled_from(URLS))]
    if draw(st.integers(0, 14)) == 0:  # now and then a stray word or option
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(["--bogus", "x", "-"])))
    return argv


@contextlib.contextmanager
def _charging(window: str) -> Iterator[None]:
    """The ledger's clock (this process) inside ``window`` for the block: a past window
    takes new releases only until its grace period is over. The commands then run on the
    real clock, the windows closed."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        ledger_time_in(monkeypatch, window)
        yield


def _seed(url: str) -> None:
    """ok, WARNING and EXHAUSTED accounts in a closed window, a policy, an open reservation."""
    ledger = AdminLedger(BudgetCap(3.0, 1e-5), url=url)
    try:
        alice, bob = key_for("alice", "heatmap", CLOSED), key_for("bob", "heatmap", CLOSED)
        with _charging(CLOSED):
            ledger.spend(alice, GaussianMechanism(4.0), count=3, attempt="heat/run1/1")
            ledger.commit(ledger.reserve([alice, bob], LaplaceMechanism(0.1), attempt="pair/1"))
            ledger.spend(bob, GaussianMechanism(1.6), attempt="heat/run1/2")
        ledger.correct(bob, GaussianMechanism(1.0), reason="missed release")
        ledger.set_policy(Policy(2.0, tenant="acme", compliance_clause="DPA s.3"))
        dave = key_for("dave", "count", "2026-w28", tenant="acme")
        with _charging(dave.window):
            ledger.reserve(dave, LaplaceMechanism(1.0))
    finally:
        ledger.close()


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli-fuzz-template") / "ledger.db"
    _seed(f"sqlite:///{path}")
    return path


@pytest.fixture
def workdir(tmp_path_factory) -> Path:
    """A folder per test: the ledger copy in ``db/``, relative paths resolved in ``cwd/``."""
    root = tmp_path_factory.mktemp("cli-fuzz")
    (root / "db").mkdir()
    (root / "cwd").mkdir()
    return root


_ERROR_LINE = re.compile(r"^dp-budget( [\w-]+)*: error: ")
_WARNING_LINE = re.compile(r"^(warning: |relative SQLite ledger path )")
_TRACE = ("Traceback", 'File "', "site-packages", '.py", line')


def run_cli(argv: list[str], ledger_path: Path) -> tuple[int, str, str]:
    """``main(argv)`` on the ledger at ``ledger_path`` (through DP_BUDGET_URL), from a folder
    beside the ledger's (relative paths a command writes, like --checkpoint, land there):
    (exit, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    url, cwd = f"sqlite:///{ledger_path}", os.getcwd()
    saved = {name: os.environ.get(name) for name in (URL_ENV, history.CHAIN_KEY_ENV)}
    os.environ[URL_ENV] = url
    os.environ.pop(history.CHAIN_KEY_ENV, None)
    # What the CLI logs reaches its stderr (Python's last-resort handler prints warnings).
    handler = logging.StreamHandler(err)
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    os.chdir(ledger_path.parent.parent / "cwd")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse: --help (0) and usage errors (2)
                code = exit_.code
    finally:
        logging.getLogger().removeHandler(handler)
        os.chdir(cwd)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return code, out.getvalue(), err.getvalue()


def check_run(argv: list[str], code: int, err: str, ledger_path: Path) -> None:
    shown = f"argv={[a[:200] for a in argv]!r}\nexit={code}\nstderr={err[:2000]!r}"
    assert code in (0, 1, 2), shown
    for marker in _TRACE:
        assert marker not in err, shown
    assert str(ledger_path) not in err and str(ledger_path.parent) not in err, shown
    # Warnings (the unkeyed history, a relative SQLite path resolved) are lines of their own.
    lines = [line for line in err.splitlines() if not _WARNING_LINE.match(line)]
    errors = [i for i, line in enumerate(lines) if _ERROR_LINE.match(line)]
    if code == 0:
        assert not errors, shown
        return
    if code == 1 and not errors:  # verify found problems / quarantine show: on stdout
        assert not lines, shown
        return
    assert len(errors) == 1 and errors[0] == len(lines) - 1, shown  # one line, the last
    before = lines[: errors[0]]
    if before:  # argparse's usage, only for usage errors
        assert code == 2 and before[0].startswith("usage: "), shown
    assert ": error: database:" not in lines[-1], shown  # a raw SQLAlchemy error is a bug


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: " ".join(command.words))
def test_every_command_with_nasty_values_fails_in_one_line(command, template, workdir):
    ledger_path = workdir / "db" / "ledger.db"

    # Examples by the command's number of values: policy set has ten, db upgrade none.
    slots = len(command.options) + len(command.positionals)

    @settings(
        max_examples=8 + 6 * slots,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(argv=argvs(command))
    def run(argv):
        shutil.copyfile(template, ledger_path)
        code, out, err = run_cli(argv, ledger_path)
        check_run(argv, code, err, ledger_path)
        if "the ledger is quarantined" in out:  # what verify says must be so
            ledger = AdminLedger(url=f"sqlite:///{ledger_path}")
            try:
                assert ledger.quarantine_status() is not None, (argv, out)
            finally:
                ledger.close()

    run()


def test_the_fuzzer_reaches_every_command():
    words = {command.words for command in COMMANDS}
    assert ("policy", "set") in words and ("reap",) in words and ("db", "adopt-key") in words
    assert len(words) == len(COMMANDS) >= 14


# The probes of issue 15 that gave tracebacks or the wrong exit code, pinned.
@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--offset", "1e30"],
        ["status", "--offset", str(2**64)],
        ["history", "--limit", "1e30"],
        ["reap", "--older-than", "99999999999999d"],
        ["policy", "set", "--length-seconds", "1e30", "--epsilon", "1"],
        ["policy", "set", "--epsilon", "-1"],
    ],
)
def test_issue_probes_are_usage_errors(argv, template, workdir):
    ledger_path = workdir / "db" / "ledger.db"
    shutil.copyfile(template, ledger_path)
    code, _, err = run_cli(argv, ledger_path)
    check_run(argv, code, err, ledger_path)
    assert code in (0, 2), err


# What this fuzzer found, pinned: (argv, exit code, words the one error line must hold).
@pytest.mark.parametrize(
    ("argv", "code", "words"),
    [
        # OverflowError tracebacks: seconds past what a timedelta holds.
        (
            ["policy", "set", "--epsilon", "1", "--min-window-seconds", "99999999999999"],
            2,
            "argument --min-window-seconds",
        ),
        (
            [
                "policy",
                "set",
                "--epsilon",
                "1",
                "--calendar",
                "fixed",
                "--length-seconds",
                str(2**63 - 1),
            ],
            2,
            "argument --length-seconds",
        ),
        # The one-more-row probe of `history` asked for 2**63 rows and named it as the limit.
        (["history", "--after", str(2**63 - 1), "--limit", str(2**63 - 1)], 0, ""),
        # A checkpoint FILE that is a folder, empty or unencodable: verify said "FAILED ...
        # the ledger is quarantined" (exit 1) about the user's typo, and did not quarantine.
        (["verify", "--checkpoint", "."], 2, "argument --checkpoint"),
        (["verify", "--checkpoint", ""], 2, "argument --checkpoint"),
        (["verify", "--checkpoint", "a\x00b"], 2, "argument --checkpoint"),
        (["verify", "--checkpoint", "c" * 300], 2, "argument --checkpoint"),
        # "embedded null byte" / a codec error about a URL; an uncaught OSError for a name
        # too long for the filesystem.
        (["--url", "sqlite:///a\x00b.db", "status"], 2, "unprintable character U+0000"),
        (["--url", "sqlite:///\udcff.db", "status"], 2, "unprintable character U+DCFF"),
        (["--url", "sqlite:////" + "z" * 5000, "status"], 1, "File name too long"),
        # warn_fraction named by its Python name and checked after opening the ledger.
        (
            ["init", "--epsilon", "3", "--delta", "1e-5", "--warn-fraction", "7"],
            2,
            "argument --warn-fraction",
        ),
        (
            ["policy", "set", "--epsilon", "1", "--warn-fraction", "1.5"],
            2,
            "argument --warn-fraction",
        ),
    ],
)
def test_fuzz_findings(argv, code, words, template, workdir):
    ledger_path = workdir / "db" / "ledger.db"
    shutil.copyfile(template, ledger_path)
    got, out, err = run_cli(argv, ledger_path)
    check_run(argv, got, err, ledger_path)
    assert got == code, (got, out, err)
    assert words in err
    assert "quarantined" not in out
