"""The ``dp-budget`` CLI, run as a real subprocess and in-process, on SQLite and PostgreSQL."""

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa

from dp_budget_provider import __version__
from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.cli import main
from dp_budget_provider.cli.arguments import parse_duration
from dp_budget_provider.ledger import AdminKey, BudgetCap, Policy, WindowCalendar, key_for
from dp_budget_provider.ledger.storage import clock as ledger_clock
from dp_budget_provider.ledger.storage import database
from tests.admin import AdminLedger, admin_key_file
from tests.ledger.checked import checked_epsilon
from tests.ledger_time import ledger_time_in

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

UTC = timezone.utc
DELTA = 1e-5
CLOSED = "2020-w01"
OPEN_WINDOW = WindowCalendar().window_of(datetime.now(UTC))
ALICE = key_for("alice", "heatmap", CLOSED)
BOB = key_for("bob", "heatmap", CLOSED)
ERIN = key_for("erin", "heatmap", CLOSED)
DAVE = key_for("dave", "count", OPEN_WINDOW, tenant="acme")
CLAUSE = "DPA 2026-04 s.3: at most eps 2 per customer per week"


@pytest.fixture(autouse=True)
def administrator(monkeypatch):
    """The shell these tests run in is an administrator's: it holds the admin key."""
    monkeypatch.setenv("DP_BUDGET_ADMIN_KEY_FILE", str(admin_key_file()))


@contextmanager
def charging(*windows):
    """Within the block the ledger's clock (this process only) is inside ``windows``: a
    past window such as CLOSED takes new releases only until its grace period is over, so
    the tests charge it there, then read and reset it on the real clock (the CLI's runs
    have no other: a process's own, or the one :func:`as_a_process` gives ``main``)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        ledger_time_in(monkeypatch, *windows)
        yield


def run_process(*args, url=None, env_url=None, chain_key=None):
    """The CLI as a user starts it: a separate process, DP_BUDGET_URL and DP_BUDGET_CHAIN_KEY
    only when asked. For what only a process shows (its start, exit, Airflow imported in
    it); every other test runs the CLI in this process with :func:`run`."""
    env = {k: v for k, v in os.environ.items() if k not in ("DP_BUDGET_URL", "DP_BUDGET_CHAIN_KEY")}
    if env_url is not None:
        env["DP_BUDGET_URL"] = env_url
    if chain_key is not None:
        env["DP_BUDGET_CHAIN_KEY"] = chain_key
    command = [sys.executable, "-m", "dp_budget_provider.cli"]
    command += ["--url", url] if url else []
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def run(*args, url=None, env_url=None, chain_key=None):
    """The CLI as a user runs it, in this process: ``main(argv)`` with what a fresh
    ``python -m dp_budget_provider.cli`` process would have (see :func:`as_a_process`).
    Returns its exit code, stdout and stderr as :func:`run_process` does."""
    argv = [*(["--url", url] if url else []), *args]
    stdout, stderr = io.StringIO(), io.StringIO()
    with as_a_process(argv, stdout, stderr, env_url=env_url, chain_key=chain_key):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse: usage errors, --help, --version
            code = exit_.code
        except Exception:  # the interpreter's report of an uncaught exception
            traceback.print_exc(file=sys.stderr)
            code = 1
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)  # sys.exit("text"): printed, exit 1
            code = 1
    return subprocess.CompletedProcess(
        ["dp-budget", *argv], code or 0, stdout.getvalue(), stderr.getvalue()
    )


# The ledger's clock of a separate process (a pin of this one is monkeypatched over it).
_REAL_CLOCK = ledger_clock.now


@contextmanager
def as_a_process(argv, stdout, stderr, *, env_url=None, chain_key=None):
    """Within the block, this process looks to ``main`` as a new CLI process would:

    * the environment of the test without DP_BUDGET_URL and DP_BUDGET_CHAIN_KEY, only
      ``env_url`` and ``chain_key`` when given; what the command sets in it (e.g.
      ``_AIRFLOW_PROCESS_CONTEXT`` for ``--conn-id``) is undone afterwards;
    * the real ledger clock, whatever pin or ``charging`` the test is under;
    * sys.stdout and sys.stderr are ``stdout`` and ``stderr``;
    * logging shows on stderr what a process shows: WARNING and above, the bare message
      (Python's last-resort handler); with ``--conn-id``, where Airflow's logging is set
      up on stderr, INFO and above; levels the command sets (alembic's) are undone;
    * warnings are printed on stderr under Python's default filters, not collected by
      pytest.
    """
    conn_id = any(arg == "--conn-id" or arg.startswith("--conn-id=") for arg in argv)
    root = logging.getLogger()
    alembic_log = logging.getLogger("alembic")
    saved_logging = (root.handlers[:], root.level, alembic_log.level)
    handler = logging.StreamHandler(stderr)
    handler.setLevel(logging.INFO if conn_id else logging.WARNING)
    if conn_id:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    with pytest.MonkeyPatch.context() as monkeypatch, warnings.catch_warnings():
        monkeypatch.delenv("DP_BUDGET_URL", raising=False)
        monkeypatch.delenv("DP_BUDGET_CHAIN_KEY", raising=False)
        if env_url is not None:
            monkeypatch.setenv("DP_BUDGET_URL", env_url)
        if chain_key is not None:
            monkeypatch.setenv("DP_BUDGET_CHAIN_KEY", chain_key)
        environment = dict(os.environ)
        monkeypatch.setattr(ledger_clock, "now", _REAL_CLOCK)
        warnings.resetwarnings()
        warnings.filterwarnings(
            "default", category=DeprecationWarning, module=r"dp_budget_provider\.cli"
        )
        for category in (
            DeprecationWarning,
            PendingDeprecationWarning,
            ImportWarning,
            ResourceWarning,
        ):
            warnings.simplefilter("ignore", category, append=True)
        warnings.showwarning = _show_warning
        root.handlers = [handler]
        root.setLevel(handler.level)
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                yield
        finally:
            root.handlers = saved_logging[0]
            root.setLevel(saved_logging[1])
            alembic_log.setLevel(saved_logging[2])
            for name in set(os.environ) - set(environment):
                del os.environ[name]
            os.environ.update(environment)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Python's own display of a warning, on the stderr of the moment."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def call(capsys, *args):
    """The CLI in-process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse usage errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(result):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dp-budget: error:"), result.stderr


def seed(url):
    """A ledger with ok, WARNING and EXHAUSTED accounts, a multi-key release, an open one."""
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=url)
    with charging(CLOSED):
        ledger.spend(ALICE, GaussianMechanism(4.0), count=3, attempt="heat/run1/1")  # seq 3, 4
        ledger.commit(ledger.reserve([ALICE, BOB], LaplaceMechanism(0.1), attempt="pair/run1/1"))
        ledger.spend(BOB, GaussianMechanism(1.6), attempt="heat/run1/2")  # past 80%
        ledger.spend(ERIN, GaussianMechanism(2.0), attempt="heat/run1/3")
    ledger.correct(ERIN, GaussianMechanism(1.0), reason="missed release")  # past the cap
    ledger.set_policy(Policy(2.0, tenant="acme", compliance_clause=CLAUSE))
    reservation = ledger.reserve(DAVE, GaussianMechanism(4.0), attempt="count/run1/1")
    ledger.close()
    return reservation


@pytest.fixture
def seeded(sqlite_url):
    seed(sqlite_url)
    return sqlite_url


@pytest.fixture
def seeded_any(ledger_url):
    seed(ledger_url)
    return ledger_url


def open_ledger(url):
    return AdminLedger(url=url)


# ---------------------------------------------------------------------- url and errors


def test_no_url_is_a_usage_error():
    result = run_process("status")
    assert result.returncode == 2
    assert_one_line_error(result)
    assert "DP_BUDGET_URL" in result.stderr


def test_url_from_environment_option_before_or_after_the_command(seeded):
    assert run("verify", env_url=seeded).returncode == 0
    assert run("verify", url=seeded).returncode == 0
    assert run("verify", "--url", seeded).returncode == 0


def test_missing_sqlite_file_is_not_created(tmp_path):
    path = tmp_path / "typo.db"
    result = run("status", url=f"sqlite:///{path}")
    assert_one_line_error(result)
    assert "no ledger database file" in result.stderr
    assert not path.exists()


def test_unreachable_database_is_one_line():
    result = run_process("status", url="postgresql+psycopg2://nobody@127.0.0.1:1/none")
    assert result.returncode == 1
    assert_one_line_error(result)


def test_console_script_is_installed(seeded):
    script = Path(sys.executable).with_name("dp-budget")
    assert script.exists()
    result = subprocess.run(
        [str(script), "--url", seeded, "verify"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and result.stdout.startswith("OK")


# ---------------------------------------------------------------------- --conn-id


def define_connection(monkeypatch, conn_id, **fields):
    """An Airflow connection as a deployment defines it: ``AIRFLOW_CONN_<ID>`` (JSON), seen
    by the CLI through the environment."""
    value = json.dumps({"conn_type": "dpbudget", **fields})
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", value)


@pytest.fixture(scope="module")
def airflow_loaded():
    """Airflow imported in this process once, before the CLI's first ``--conn-id`` (which
    would import it inside its captured output): a new process imports it on every call,
    the in-process runs share one import; a test of the import in a process of its own is
    test_conn_id_reads_the_metadata_database_and_stdout_is_only_output."""
    import dp_budget_provider.hooks.dp_budget  # noqa: F401
    import dp_budget_provider.hooks.maintenance  # noqa: F401


def without_airflow(*args):
    """The CLI in a process where ``import airflow`` fails, as on a machine without it."""
    code = (
        "import sys; sys.modules['airflow'] = None; from dp_budget_provider.cli import main; "
        f"sys.exit(main({list(args)!r}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DP_BUDGET_URL", "DP_BUDGET_CHAIN_KEY")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )


def test_conn_id_opens_the_ledger_and_chain_key_the_tasks_use(
    monkeypatch, airflow_loaded, ledger_url
):
    """The connection's extra.url and extra.chain_key, exactly as DPBudgetHook reads them:
    the keyed ledger opens with no DP_BUDGET_URL or DP_BUDGET_CHAIN_KEY anywhere."""
    from dp_budget_provider.hooks.dp_budget import DPBudgetHook

    define_connection(monkeypatch, "ledger_cli", extra={"url": ledger_url, "chain_key": CHAIN_KEY})
    created = run("--conn-id", "ledger_cli", "init", "--epsilon", "3", "--delta", "1e-5")
    assert created.returncode == 0, created.stderr
    hook = DPBudgetHook("ledger_cli")
    ledger = AdminLedger(url=hook.ledger_url(), chain_key=hook.chain_key())
    with charging(CLOSED):
        ledger.spend(ALICE, GaussianMechanism(4.0))
    ledger.close()
    verified = run("verify", "--conn-id", "ledger_cli")  # after the command too
    assert verified.returncode == 0, verified.stderr
    assert "not keyed" not in verified.stderr
    status = run("--conn-id", "ledger_cli", "status")
    assert status.returncode == 0, status.stderr
    assert "alice" in status.stdout
    assert "Running upgrade" not in created.stdout + created.stderr


def test_conn_id_with_host_fields_builds_the_postgresql_url(
    monkeypatch, airflow_loaded, postgres_url
):
    parsed = sa.engine.make_url(postgres_url)
    define_connection(
        monkeypatch,
        "ledger_fields",
        host=parsed.host,
        port=parsed.port,
        login=parsed.username,
        schema=parsed.database,
    )
    created = run("--conn-id", "ledger_fields", "init", "--epsilon", "3", "--delta", "1e-5")
    assert created.returncode == 0, created.stderr
    assert f"@{parsed.host}:{parsed.port}/{parsed.database}" in created.stdout


@pytest.mark.parametrize("conn_type", ["dpbudget", "dp_budget"])
def test_conn_id_reads_the_metadata_database_and_stdout_is_only_output(
    airflow_db, sqlite_url, conn_type
):
    """A connection saved with `airflow connections add` (the metadata database, not the
    environment) is found as the tasks' hook finds it, and stdout carries only the command's
    output: Airflow printed "Connection schemes (type: dp_budget) shall not contain '_'" on
    stdout on every call, so `classes --json` did not parse and a report redirected to a
    file began with a log line. The type is dpbudget now; one of the earlier type dp_budget
    still works, its warning on stderr."""
    airflow = str(Path(sys.executable).with_name("airflow"))
    conn_id = f"ledger_db_{os.getpid()}_{time.monotonic_ns()}"
    added = subprocess.run(
        [airflow, "connections", "add", conn_id, "--conn-type", conn_type]
        + ["--conn-extra", json.dumps({"url": sqlite_url, "chain_key_secret": CHAIN_KEY})],
        capture_output=True,
        text=True,
        check=False,
    )
    assert added.returncode == 0, added.stderr
    ledger = AdminLedger(BudgetCap(3.0, 1e-5), url=sqlite_url, chain_key=CHAIN_KEY)
    with charging(CLOSED):
        ledger.spend(ALICE, GaussianMechanism(4.0))
    ledger.close()
    classes = run_process("--conn-id", conn_id, "classes", "--json")
    assert classes.returncode == 0, classes.stderr
    assert json.loads(classes.stdout)["total"] == 1
    assert ("shall not contain '_'" in classes.stderr) == (conn_type == "dp_budget")
    if conn_type == "dp_budget":
        return  # the earlier type: found, and warned about on stderr only
    report = run_process("--conn-id", conn_id, "report", "--format", "md")
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith("# Privacy report\n")
    assert "shall not contain" not in report.stderr


def test_conn_id_from_the_environment_gives_parseable_json(monkeypatch, airflow_loaded, sqlite_url):
    define_connection(monkeypatch, "ledger_env", extra={"url": sqlite_url})
    assert (
        run("--conn-id", "ledger_env", "init", "--epsilon", "3", "--delta", "1e-5").returncode == 0
    )
    result = run("--conn-id", "ledger_env", "status", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["total"] == 0


def test_an_unknown_conn_id_is_one_line_naming_it(airflow_loaded):
    result = run("--conn-id", "no_such_ledger", "status")
    assert result.returncode == 1
    assert_one_line_error(result)
    assert "--conn-id no_such_ledger" in result.stderr
    assert "AIRFLOW_CONN_NO_SUCH_LEDGER" in result.stderr


def test_a_connection_without_url_or_host_is_one_line(monkeypatch, airflow_loaded):
    define_connection(monkeypatch, "ledger_empty")
    result = run("--conn-id", "ledger_empty", "status")
    assert_one_line_error(result)
    assert "neither extra.url nor a host" in result.stderr


@pytest.mark.parametrize("how", ["option", "environment"])
def test_conn_id_and_url_are_exclusive(seeded, how):
    if how == "option":
        result = run("--conn-id", "dp_budget_default", "status", url=seeded)
    else:
        result = run("--conn-id", "dp_budget_default", "status", env_url=seeded)
    assert result.returncode == 2
    assert_one_line_error(result)
    assert "--conn-id and --url/DP_BUDGET_URL" in result.stderr


def test_conn_id_without_airflow_is_one_line_and_url_still_works(seeded):
    refused = without_airflow("--conn-id", "dp_budget_default", "status")
    assert refused.returncode == 2
    assert_one_line_error(refused)
    assert "--conn-id needs Apache Airflow" in refused.stderr
    verified = without_airflow("--url", seeded, "verify")
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.startswith("OK")


# ---------------------------------------------------------------------- db upgrade, init


def test_db_upgrade_then_init_on_an_empty_database(ledger_url):
    result = run("db", "upgrade", url=ledger_url)
    assert result.returncode == 0, result.stderr
    assert f"revision {database.head_revision()}" in result.stdout
    assert run("db", "upgrade", url=ledger_url).returncode == 0  # idempotent

    not_yet = run("status", url=ledger_url)
    assert_one_line_error(not_yet)
    assert "dp-budget init" in not_yet.stderr

    created = run("init", "--epsilon", "3", "--delta", "1e-5", url=ledger_url)
    assert created.returncode == 0, created.stderr
    assert "created" in created.stdout
    ledger = open_ledger(ledger_url)
    assert ledger.delta == DELTA
    assert ledger.policies()[0].cap_epsilon == 3.0
    ledger.close()


def test_a_sqlite_ledger_in_a_missing_folder_is_named_then_created_by_init(tmp_path, capsys):
    folder = tmp_path / "ledgers" / "prod"
    url = f"sqlite:///{folder / 'ledger.db'}"
    code, _, err = call(capsys, "--url", url, "status")
    assert code == 1 and f"its folder {folder} does not exist" in err and "dp-budget init" in err
    assert not folder.exists()  # reading never creates anything
    code, out, err = call(capsys, "--url", url, "init", "--epsilon", "3", "--delta", "1e-5")
    assert code == 0, err
    assert f"created folder {folder}" in out and "created:" in out
    assert call(capsys, "--url", url, "status")[0] == 0


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_plain_postgresql_urls_work_in_the_cli(postgres_url, scheme):
    url = f"{scheme}://{postgres_url.split('://', 1)[1]}"
    created = run("init", "--epsilon", "3", "--delta", "1e-5", url=url)
    assert created.returncode == 0, created.stderr
    assert run("status", url=url).returncode == 0


def test_init_is_idempotent_and_refuses_another_configuration(sqlite_url, capsys):
    code, out, _ = call(capsys, "--url", sqlite_url, "init", "--epsilon", "3", "--delta", "1e-6")
    assert code == 0 and "created" in out and "checked at Rényi order" in out
    code, out, _ = call(capsys, "--url", sqlite_url, "init", "--epsilon", "3", "--delta", "1e-6")
    assert code == 0 and "exists already" in out
    result = run("init", "--epsilon", "3", "--delta", "1e-5", url=sqlite_url)
    assert_one_line_error(result)
    assert "delta" in result.stderr


def test_init_says_how_the_default_cap_is_checked(sqlite_url, tmp_path, capsys):
    """A ledger whose default cap is checked on the reported epsilon (asked for, or made by
    whoever created it first) is named so by init, with a warning: it is not a filter."""
    code, out, err = call(
        capsys, "--url", sqlite_url, "init", "--epsilon", "3", "--delta", "1e-6",
        "--filter-order", "reported",
    )  # fmt: skip
    assert code == 0 and "checked on the reported epsilon" in out and "not a" in err
    code, out, err = call(capsys, "--url", sqlite_url, "init", "--epsilon", "3", "--delta", "1e-6")
    assert code == 0 and "exists already" in out and "checked on the reported epsilon" in out
    other = f"sqlite:///{tmp_path / 'other.db'}"
    code, out, err = call(
        capsys, "--url", other, "init", "--epsilon", "3", "--delta", "1e-6", "--filter-order", "63"
    )
    assert code == 0 and "checked at Rényi order 63" in out and err == ""


def test_a_classic_ledger_opens_with_its_own_conversion(sqlite_url, capsys):
    assert (
        run(
            "init", "--epsilon", "9", "--delta", "1e-5", "--conversion", "classic", url=sqlite_url
        ).returncode
        == 0
    )
    ledger = AdminLedger(url=sqlite_url, conversion="classic")
    with charging(CLOSED):
        ledger.spend(ALICE, GaussianMechanism(4.0), count=20)
    ledger.close()
    code, out, _ = call(capsys, "--url", sqlite_url, "status", "--json")
    assert code == 0
    document = json.loads(out)
    assert document["ledger"]["conversion"] == "classic"
    assert document["accounts"][0]["epsilon"] == pytest.approx(5.989924526737262)


@pytest.mark.parametrize(
    "args",
    [
        ("--epsilon", "0", "--delta", "1e-5"),
        ("--epsilon", "3", "--delta", "1.5"),
        ("--epsilon", "3", "--delta", "1e-5", "--warn-fraction", "2"),
    ],
)
def test_init_rejects_invalid_caps(sqlite_url, args):
    result = run("init", *args, url=sqlite_url)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(("dp-budget: error:", "dp-budget init: error:"))
    )


# ---------------------------------------------------------------------- status


def table(out):
    """Header and rows of the first aligned table in ``out``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(("TENANT", "SEQ")))
    rows = []
    for line in lines[start + 1 :]:
        if (
            not line.strip()
            or line.startswith(("showing", "more entries", "older entries"))
            or "account(s)" in line
        ):
            break
        rows.append(line)
    return lines[start], rows


def test_status_table_is_aligned_with_states(seeded_any):
    result = run("status", url=seeded_any)
    assert result.returncode == 0, result.stderr
    header, rows = table(result.stdout)
    assert "delta=1e-05" in result.stdout.splitlines()[0]
    assert len(rows) == 4
    state_at = header.index("STATE")
    states = {row.split()[1]: row[state_at:].strip() for row in rows}
    assert states == {"alice": "ok", "bob": "WARNING", "erin": "EXHAUSTED", "dave": "ok"}
    ledger = open_ledger(seeded_any)
    eps_end = header.index("EPS") + len("EPS")
    for row in rows:
        tenant, subject, query_type, window = row.split()[:4]
        epsilon = ledger.receipt(key_for(subject, query_type, window, tenant=tenant)).epsilon
        assert row[:eps_end].endswith(f"{epsilon:.4f}")  # right-aligned under EPS
    ledger.close()
    dave = next(row for row in rows if " dave " in row)
    assert dave[header.index("OPEN") : header.index("OPEN") + 4].strip() == "1"
    assert "4 account(s)" in result.stdout


def test_status_json_and_filters(seeded_any, capsys):
    code, out, _ = call(capsys, "--url", seeded_any, "status", "--json", "--window", "2020-W01")
    assert code == 0
    document = json.loads(out)
    assert document["total"] == 3
    assert document["filters"] == {
        "window": CLOSED,
        "tenant": None,
        "sealed": False,
        "subject": None,
    }
    by_subject = {a["subject"]: a for a in document["accounts"]}
    assert set(by_subject) == {"alice", "bob", "erin"}
    assert by_subject["erin"]["state"] == "EXHAUSTED"
    assert by_subject["bob"]["state"] == "WARNING"
    assert by_subject["alice"]["delta"] == DELTA
    assert by_subject["alice"]["releases"] == 4

    code, out, _ = call(capsys, "--url", seeded_any, "status", "--tenant", "ACME", "--json")
    assert [a["subject"] for a in json.loads(out)["accounts"]] == ["dave"]


def test_status_pages_large_ledgers(sqlite_url, capsys):
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=sqlite_url)
    keys = [key_for(f"user{i:03d}", "count", CLOSED) for i in range(60)]
    with charging(CLOSED):
        ledger.commit(ledger.reserve(keys, GaussianMechanism(5.0)))
    ledger.close()
    code, out, _ = call(capsys, "--url", sqlite_url, "status")
    assert code == 0
    assert len(table(out)[1]) == 50
    assert "showing 1-50 of 60 accounts; 10 more not shown" in out
    code, out, _ = call(capsys, "--url", sqlite_url, "status", "--offset", "50")
    assert [row.split()[1] for row in table(out)[1]] == [f"user{i:03d}" for i in range(50, 60)]
    code, out, _ = call(capsys, "--url", sqlite_url, "status", "--limit", "0")
    assert len(table(out)[1]) == 60 and "more not shown" not in out


def test_status_of_an_empty_ledger(sqlite_url, capsys):
    AdminLedger(BudgetCap(3.0, DELTA), url=sqlite_url).close()
    code, out, _ = call(capsys, "--url", sqlite_url, "status")
    assert code == 0 and "no accounts" in out


def test_classes_group_a_cohort_and_list_a_class_members(ledger_url, capsys):
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=ledger_url)
    keys = [key_for(f"user{i:03d}", "count", CLOSED) for i in range(60)]
    with charging(CLOSED):
        ledger.commit(ledger.reserve(keys, GaussianMechanism(5.0)))
        ledger.commit(ledger.reserve(keys[:45], GaussianMechanism(5.0)))
    ledger.close()
    code, out, _ = call(capsys, "--url", ledger_url, "classes")
    assert code == 0
    header, rows = table(out)
    assert header.split()[:5] == ["TENANT", "QUERY", "TYPE", "WINDOW", "SUBJECTS"]
    assert [row.split()[3:5] for row in rows] == [["45", "user000"], ["15", "user045"]]
    assert "showing 1-2 of 2 spend class(es)" in out
    bigger = rows[0].split()[-1]
    code, out, _ = call(
        capsys, "--url", ledger_url, "classes", "--members", bigger, "--query-type", "count",
        "--window", CLOSED, "--limit", "3", "--offset", "1",
    )  # fmt: skip
    assert code == 0
    assert out.splitlines() == ["user001", "user002", "user003", "showing 2-4 of 45 subject(s)"]
    code, out, _ = call(capsys, "--url", ledger_url, "classes", "--subject", "user05*", "--json")
    found = json.loads(out)["classes"]
    assert [(c["subjects"], c["first_subject"], c["releases"]) for c in found] == [
        (10, "user050", 1)
    ]
    missing = run("classes", "--members", bigger, url=ledger_url)
    assert_one_line_error(missing)
    assert missing.returncode == 2 and "--query-type" in missing.stderr


# ---------------------------------------------------------------------- show, history


def test_show_account_policy_and_history(seeded_any):
    result = run("show", "--tenant", "acme", "dave", "count", OPEN_WINDOW, url=seeded_any)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"account   acme/dave/count/{OPEN_WINDOW}" in out
    assert "1 open reservation(s)" in out
    assert "scope acme/*: cap 2" in out
    assert f"clause    {CLAUSE}" in out
    header, rows = table(out)
    assert [row.split()[2] for row in rows] == ["reserve"]
    assert "gaussian(noise_multiplier=4) x1" in rows[0]


def test_status_and_show_count_what_open_reservations_hold(seeded_any, capsys):
    """dave has nothing committed and one open reservation: its held eps and the budget
    left after it are shown, in the table, in JSON and by show."""
    ledger = open_ledger(seeded_any)
    held = ledger.prospective_accountant(DAVE).epsilon_bound(DELTA).epsilon
    ledger.close()
    assert held > 0.5
    # What is left is counted as the cap check counts: at the cap's filter order.
    left = 2.0 - checked_epsilon(2.0, DELTA, (GaussianMechanism(4.0), 1))
    code, out, _ = call(capsys, "--url", seeded_any, "status", "--tenant", "acme")
    assert code == 0
    header, (row,) = table(out)
    cells = dict(zip(header.split()[-9:], row.split()[-9:], strict=True))
    assert cells["EPS"] == "0.0000" and cells["CAP"] == "2.0000"
    assert cells["HELD"] == f"{held:.4f}" and cells["REMAINING"] == f"{left:.4f}"
    assert "HELD also counts the OPEN reservations as charged" in out
    code, out, _ = call(capsys, "--url", seeded_any, "status", "--tenant", "acme", "--json")
    (record,) = json.loads(out)["accounts"]
    assert record["epsilon"] == 0.0 and record["remaining"] == 2.0
    assert record["held_epsilon"] == pytest.approx(held, rel=1e-12)
    assert record["remaining_after_held"] == pytest.approx(left, rel=1e-12)
    code, out, _ = call(
        capsys, "--url", seeded_any, "show", "--tenant", "acme", "dave", "count", OPEN_WINDOW
    )
    assert code == 0
    assert f"held      {held:.6g} with its open reservations charged: remaining " in out
    assert f"remaining {left:.6g}" in out


def test_show_default_tenant_lists_multi_key_releases(seeded):
    result = run("show", "Alice", "heatmap", "2020-W01", url=seeded)  # canonicalised
    assert result.returncode == 0, result.stderr
    ledger = open_ledger(seeded)
    expected = [e["seq"] for e in ledger.history(ALICE)]
    epsilon = ledger.receipt(ALICE).epsilon
    ledger.close()
    _, rows = table(result.stdout)
    assert [int(row.split()[0]) for row in rows] == expected
    assert any("2 subjects" in row and "laplace(epsilon0=0.1)" in row for row in rows)
    assert f"epsilon   {epsilon:.6g} at delta 1e-05" in result.stdout
    assert "clause    (none recorded)" in result.stdout


def test_show_unknown_key_fails(seeded):
    result = run("show", "mallory", "heatmap", CLOSED, url=seeded)
    assert_one_line_error(result)
    assert "no account and no history" in result.stderr


def test_names_in_errors_are_kept_as_written(seeded, capsys):
    """Option wording is for the commands that check values under Python names; a key
    part spelled like one stays as it is."""
    code, _, err = call(capsys, "--url", seeded, "show", "set_policy", "cap_epsilon", CLOSED)
    assert code == 1 and "default/set_policy/cap_epsilon/2020-w01" in err
    code, _, err = call(capsys, "--url", seeded, "policy", "set", "--epsilon", "-1")
    assert code == 2 and "--epsilon" in err and "cap_epsilon" not in err


def test_show_a_reset_account_keeps_its_history(seeded, capsys):
    live = call(capsys, "--url", seeded, "show", "alice", "heatmap", CLOSED)[1].splitlines()
    assert call(capsys, "--url", seeded, "reset", "--window", CLOSED)[0] == 0
    code, out, _ = call(capsys, "--url", seeded, "show", "alice", "heatmap", CLOSED)
    assert code == 0
    # The sealed window's final spend, as it was live, never zero.
    assert "state     SEALED" in out.splitlines()
    spend = [line for line in live if line.startswith(("epsilon ", "releases "))]
    assert len(spend) == 2 and all(line in out.splitlines() for line in spend)
    _, rows = table(out)
    assert [row.split()[2] for row in rows] == ["reserve", "commit", "reserve", "commit"]


def test_show_history_and_policies_as_json(seeded, capsys):
    code, out, _ = call(capsys, "--url", seeded, "show", "erin", "heatmap", CLOSED, "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["key"] == ERIN.as_dict()
    assert shown["account"]["state"] == "EXHAUSTED" and shown["account"]["releases"] == 2
    ledger = open_ledger(seeded)
    assert shown["account"]["epsilon"] == ledger.receipt(ERIN).epsilon
    assert shown["policy"] == ledger.policy_for(ERIN).as_record()
    assert [e["action"] for e in shown["history"]] == ["reserve", "commit", "correction"]
    every = [e["seq"] for e in ledger.history()]
    ledger.close()

    code, out, _ = call(capsys, "--url", seeded, "history", "--json", "--limit", "2")
    page = json.loads(out)
    assert code == 0 and page["more"] is True
    assert [e["seq"] for e in page["entries"]] == every[:2]
    code, out, _ = call(capsys, "--url", seeded, "history", "--json", "--limit", "0")
    assert [e["seq"] for e in json.loads(out)["entries"]] == every
    assert json.loads(out)["more"] is False

    code, out, _ = call(capsys, "--url", seeded, "policy", "list", "--json")
    assert code == 0
    assert [(p["tenant"], p["query_type"]) for p in json.loads(out)] == [("*", "*"), ("acme", "*")]
    assert json.loads(out)[1]["compliance_clause"] == CLAUSE

    assert call(capsys, "--url", seeded, "reset", "--window", CLOSED)[0] == 0
    code, out, _ = call(capsys, "--url", seeded, "show", "erin", "heatmap", CLOSED, "--json")
    after_reset = json.loads(out)
    assert code == 0 and after_reset["account"]["state"] == "SEALED"
    assert after_reset["account"]["sealed_at"] is not None
    live = {**after_reset["account"], "state": "EXHAUSTED", "sealed_at": None}
    assert live == shown["account"]  # the final spend, as it was live
    assert after_reset["history"][:3] == shown["history"]


def test_history_one_line_per_entry(seeded_any):
    result = run("history", url=seeded_any)
    assert result.returncode == 0, result.stderr
    ledger = open_ledger(seeded_any)
    entries = ledger.history()
    ledger.close()
    _, rows = table(result.stdout)
    assert [int(row.split()[0]) for row in rows] == [e["seq"] for e in entries]
    assert [row.split()[2] for row in rows] == [e["action"] for e in entries]
    commit = rows[3]
    assert "default/alice/heatmap/2020-w01" in commit
    assert "gaussian(noise_multiplier=4) x3" in commit and "attempt heat/run1/1" in commit
    correction = next(row for row in rows if row.split()[2] == "correction")
    assert "reason: missed release" in correction


def test_history_pages(seeded, capsys):
    code, out, _ = call(capsys, "--url", seeded, "history", "--limit", "2")
    _, rows = table(out)
    assert [int(row.split()[0]) for row in rows] == [1, 2]
    assert "more entries follow: --after 2" in out
    code, out, _ = call(capsys, "--url", seeded, "history", "--after", "3", "--limit", "1")
    assert [int(row.split()[0]) for row in table(out)[1]] == [4]
    code, out, _ = call(capsys, "--url", seeded, "history", "--after", "999")
    assert code == 0 and "no history entries after seq 999" in out


def test_history_newest_first_pages_backwards(seeded, capsys):
    every = [int(row.split()[0]) for row in table(call(capsys, "--url", seeded, "history")[1])[1]]
    code, out, _ = call(capsys, "--url", seeded, "history", "--newest-first", "--limit", "2")
    assert code == 0
    newest = [int(row.split()[0]) for row in table(out)[1]]
    assert newest == every[::-1][:2]
    assert f"older entries: --newest-first --before {newest[-1]}" in out
    code, out, _ = call(
        capsys, "--url", seeded, "history", "--newest-first", "--before", str(newest[-1])
    )
    assert [int(row.split()[0]) for row in table(out)[1]] == every[::-1][2:]


# ---------------------------------------------------------------------- verify


def test_verify_ok(seeded_any):
    result = run("verify", url=seeded_any)
    ledger = open_ledger(seeded_any)
    entries = len(ledger.history())
    ledger.close()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"OK: {entries} history entries, 4 accounts")


def test_verify_detects_a_history_row_edited_with_sql(seeded_any):
    engine = sa.create_engine(seeded_any)
    with engine.begin() as connection:
        payload = connection.execute(sa.text("SELECT payload FROM dp_history WHERE seq = 3"))
        edited = json.loads(payload.scalar_one())
        assert edited["mechanism"] == {"kind": "gaussian", "noise_multiplier": 4.0}
        edited["mechanism"]["noise_multiplier"] = 40.0  # hide most of the cost
        connection.execute(
            sa.text("UPDATE dp_history SET payload = :payload WHERE seq = 3"),
            {"payload": json.dumps(edited)},
        )
    engine.dispose()
    result = run("verify", url=seeded_any)
    assert result.returncode == 1
    assert result.stdout.startswith("FAILED:")
    assert "entry 3: content does not match its hash (entry edited or forged)" in result.stdout
    assert "Traceback" not in result.stderr


def test_verify_that_cannot_complete_fails(seeded, capsys):
    engine = sa.create_engine(seeded)
    with engine.begin() as connection:  # a corrupt stored curve makes verify() raise
        nan_curve = "[" + ",".join(["NaN"] * 156) + "]"
        connection.execute(sa.text("UPDATE dp_accounts SET residual = :r"), {"r": nan_curve})
    engine.dispose()
    code, out, err = call(capsys, "--url", seeded, "verify")
    assert code == 1
    assert "FAILED" in out and "stored spend is corrupt" in out and "quarantined" in out
    assert "Traceback" not in err


CHAIN_KEY = "cli-test-chain-key-0123456789"


@pytest.fixture
def keyed(sqlite_url):
    """A keyed ledger (DP_BUDGET_CHAIN_KEY set for in-process calls) with two releases."""
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=sqlite_url, chain_key=CHAIN_KEY)
    with charging(CLOSED):
        ledger.spend(ALICE, GaussianMechanism(4.0))
        ledger.spend(BOB, GaussianMechanism(4.0))
    ledger.close()
    return sqlite_url


@pytest.mark.parametrize(
    "content",
    [
        "this is a README, not a checkpoint\n",
        '{"format": "dp-budget-checkpoint/1"}\n',
        '{"some": "other json"}\n[1, 2, 3]\n',
        b"\xff\xfe\x00 binary",
    ],
)
def test_a_checkpoint_file_that_is_no_checkpoint_is_a_usage_error(
    tmp_path, keyed, capsys, monkeypatch, content
):
    """The wrong file (or garbage) is the user's mistake: exit 2 naming the option, and the
    healthy ledger is not quarantined."""
    monkeypatch.setenv("DP_BUDGET_CHAIN_KEY", CHAIN_KEY)
    store = tmp_path / "wrong.txt"
    store.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = store.read_bytes()
    code, out, err = call(capsys, "--url", keyed, "verify", "--checkpoint", str(store))
    assert code == 2 and out == "", err
    assert "argument --checkpoint" in err and "is not a checkpoint file" in err
    assert store.read_bytes() == before
    ledger = AdminLedger(url=keyed, chain_key=CHAIN_KEY)
    assert ledger.quarantine_status() is None
    ledger.close()


def test_a_checkpoint_that_does_not_match_still_fails_verify(tmp_path, keyed, capsys, monkeypatch):
    """A well-formed checkpoint with a forged MAC, or another ledger's, is tampering as before."""
    monkeypatch.setenv("DP_BUDGET_CHAIN_KEY", CHAIN_KEY)
    store = tmp_path / "checkpoints.jsonl"
    code, _, err = call(capsys, "--url", keyed, "verify", "--checkpoint", str(store))
    assert code == 0, err
    record = json.loads(store.read_text())
    record["entries"] += 1  # edited: the MAC no longer matches
    forged = tmp_path / "forged.jsonl"
    forged.write_text(json.dumps(record) + "\n")
    code, out, _ = call(capsys, "--url", keyed, "verify", "--checkpoint", str(forged))
    assert code == 1 and "MAC does not match" in out and "quarantined" in out
    ledger = AdminLedger(url=keyed, chain_key=CHAIN_KEY)
    assert ledger.quarantine_status() is not None
    ledger.close()


def test_a_keyed_ledger_verifies_against_its_checkpoints_and_quarantines(tmp_path, ledger_url):
    """verify --checkpoint appends a sealed checkpoint; a tail truncated below it is
    caught, the ledger quarantined until an audited clear."""
    assert (
        run(
            "init", "--epsilon", "3", "--delta", "1e-5", url=ledger_url, chain_key=CHAIN_KEY
        ).returncode
        == 0
    )
    ledger = AdminLedger(url=ledger_url, chain_key=CHAIN_KEY)
    with charging(CLOSED):
        ledger.spend(ALICE, GaussianMechanism(4.0))
        ledger.spend(BOB, GaussianMechanism(4.0))
    ledger.close()
    store = tmp_path / "checkpoints.jsonl"
    ok = run("verify", "--checkpoint", str(store), url=ledger_url, chain_key=CHAIN_KEY)
    assert ok.returncode == 0, ok.stderr
    assert f"checkpointed in {store}" in ok.stdout and "not keyed" not in ok.stderr
    assert len(store.read_text().splitlines()) == 1
    without = run("status", url=ledger_url)
    assert_one_line_error(without)
    assert "open it with its chain key" in without.stderr
    engine = sa.create_engine(ledger_url)  # drop the newest entry, move its head back
    with engine.begin() as connection:
        seq, chain = connection.execute(
            sa.text("SELECT seq, chain FROM dp_history ORDER BY seq DESC LIMIT 1")
        ).one()
        prev = connection.execute(
            sa.text(
                "SELECT seq, hash FROM dp_history WHERE chain = :c AND seq < :s "
                "ORDER BY seq DESC LIMIT 1"
            ),
            {"c": chain, "s": seq},
        ).one()
        connection.execute(sa.text("DELETE FROM dp_history WHERE seq = :s"), {"s": seq})
        connection.execute(
            sa.text("UPDATE dp_chain_head SET seq = :q, hash = :h WHERE id = :c"),
            {"q": prev.seq, "h": prev.hash, "c": chain},
        )
    engine.dispose()
    failed = run("verify", "--checkpoint", str(store), url=ledger_url, chain_key=CHAIN_KEY)
    assert failed.returncode == 1
    assert "history truncated" in failed.stdout and "quarantined" in failed.stdout
    assert len(store.read_text().splitlines()) == 1  # a failed verify is not checkpointed
    shown = run("quarantine", "show", url=ledger_url, chain_key=CHAIN_KEY)
    assert shown.returncode == 1 and shown.stdout.startswith("QUARANTINED since")
    assert run("quarantine", "clear", url=ledger_url, chain_key=CHAIN_KEY).returncode == 2
    cleared = run(
        "quarantine",
        "clear",
        "--reason",
        "restored from backup; INC-7",
        url=ledger_url,
        chain_key=CHAIN_KEY,
    )
    assert cleared.returncode == 0, cleared.stderr
    assert "restored from backup; INC-7" in cleared.stdout
    assert run("quarantine", "show", url=ledger_url, chain_key=CHAIN_KEY).returncode == 0
    history = run("history", url=ledger_url, chain_key=CHAIN_KEY).stdout
    assert "quarantine" in history and "unquarantine" in history


def test_db_adopt_key_keys_an_unkeyed_ledger(seeded):
    unkeyed = run("verify", url=seeded)
    assert unkeyed.returncode == 0 and "history is not keyed" in unkeyed.stderr
    assert run("db", "adopt-key", url=seeded).returncode == 2  # no key in the environment
    adopted = run("db", "adopt-key", url=seeded, chain_key=CHAIN_KEY)
    assert adopted.returncode == 0, adopted.stderr
    keyed = run("verify", url=seeded, chain_key=CHAIN_KEY)
    assert keyed.returncode == 0, keyed.stdout
    assert "not keyed" not in keyed.stderr
    assert_one_line_error(run("verify", url=seeded))
    again = run("db", "adopt-key", url=seeded, chain_key=CHAIN_KEY)
    assert_one_line_error(again)


# ---------------------------------------------------------------------- reset, reap


def test_reset_refuses_an_open_window(seeded):
    result = run("reset", "--window", OPEN_WINDOW, url=seeded)
    assert_one_line_error(result)
    assert "open" in result.stderr
    ledger = open_ledger(seeded)
    assert [s.key for s in ledger.accounts(window=OPEN_WINDOW)] == [DAVE]
    ledger.close()


@pytest.mark.parametrize("window", ["9999-12-31", "2100-w01", "current"])
def test_reset_refuses_a_window_that_has_not_closed_even_if_never_charged(seeded, window):
    """Not "0 account(s) dropped": that would read as done while the window's runs are due."""
    window = WindowCalendar().window_of(datetime.now(UTC)) if window == "current" else window
    result = run("reset", "--window", window, url=seeded)
    assert result.returncode == 1
    assert_one_line_error(result)
    assert "has not closed" in result.stderr and "dropped" not in result.stdout


def test_reset_refuses_a_label_that_is_no_calendar_window(seeded):
    result = run("reset", "--window", "forever", url=seeded)
    assert result.returncode == 2 and "is not a window label" in result.stderr


@pytest.mark.parametrize(
    "command",
    [
        ("status", "--window", "bogus"),
        ("classes", "--window", "bogus"),
        ("report", "--window", "2026-w99"),
        ("reset", "--window", "bogus"),
        ("show", "alice", "heatmap", "bogus"),
    ],
)
def test_a_window_that_no_calendar_names_is_a_usage_error(seeded, capsys, command):
    """A typo in a window would otherwise list nothing and exit 0, as if the window were empty."""
    code, out, err = call(capsys, "--url", seeded, *command)
    assert code == 2 and out == ""
    assert "is not a window label" in err and "Traceback" not in err


def test_window_filters_take_any_case_and_classes_takes_patterns(seeded, capsys):
    code, out, err = call(capsys, "--url", seeded, "status", "--window", "2020-W01", "--json")
    assert code == 0, err
    assert json.loads(out)["total"] == 3
    code, out, err = call(capsys, "--url", seeded, "classes", "--window", "2020-*", "--json")
    assert code == 0, err
    assert json.loads(out)["total"] >= 1


def test_reset_one_closed_window_keeps_history(seeded):
    ledger = open_ledger(seeded)
    before = len(ledger.history())
    ledger.close()
    result = run("reset", "--window", "2020-W01", url=seeded)
    assert result.returncode == 0, result.stderr
    assert "reset window 2020-w01: 3 account(s) dropped, history kept" in result.stdout
    ledger = open_ledger(seeded)
    assert [s.key for s in ledger.accounts()] == [DAVE]
    assert len(ledger.history()) == before + 1
    assert ledger.verify().ok
    ledger.close()


def test_reset_closed_resets_every_closed_window(seeded, capsys):
    code, out, _ = call(capsys, "--url", seeded, "reset", "--closed")
    assert code == 0
    assert out.splitlines() == ["reset window 2020-w01: 3 account(s) dropped, history kept"]
    code, out, _ = call(capsys, "--url", seeded, "reset", "--closed")
    assert code == 0 and "no closed window has live accounts" in out


def test_reset_needs_a_window_or_closed(seeded, capsys):
    assert call(capsys, "--url", seeded, "reset")[0] == 2
    assert call(capsys, "--url", seeded, "reset", "--closed", "--window", CLOSED)[0] == 2


def test_reap_charges_a_reservation_whose_lease_ran_out(sqlite_url, capsys, monkeypatch):
    reservation = seed(sqlite_url)  # leased for 5 minutes
    young = run("reap", "--older-than", "1h", url=sqlite_url)
    assert young.returncode == 0, young.stderr
    assert (
        young.stdout == "no open reservation's lease has run out and none is older than 1:00:00\n"
    )
    assert run("reap", url=sqlite_url).stdout == "no open reservation's lease has run out\n"

    later = datetime.now(UTC) + timedelta(minutes=10)
    monkeypatch.setattr(ledger_clock, "now", lambda: later)  # only a test moves the clock
    code, out, err = call(capsys, "--url", sqlite_url, "reap")
    assert code == 0, err
    assert f"reaped {reservation.id}" in out
    assert "1 reservation(s) charged" in out
    ledger = open_ledger(sqlite_url)
    assert ledger.epsilon_of(DAVE) == pytest.approx(reservation.prospective_epsilon)
    assert ledger.open_reservations() == []
    assert ledger.history()[-1]["action"] == "reap"
    assert "its lease ran out at" in ledger.history()[-1]["payload"]["reason"]
    assert ledger.verify().ok
    ledger.close()


def test_reap_help_says_what_is_charged(capsys):
    code, out, _ = call(capsys, "reap", "--help")
    assert code == 0
    assert "their lease ran out; never refunded" in " ".join(out.split())
    assert "even one whose lease is still renewed" in " ".join(out.split())


def test_reap_with_a_short_duration_after_a_pause(seeded, capsys):
    time.sleep(0.3)
    code, out, _ = call(capsys, "--url", seeded, "reap", "--older-than", "0.2s")
    assert code == 0
    assert out.splitlines()[-1] == "1 reservation(s) charged (never refunded)"


@pytest.mark.parametrize("duration", ["2", "h", "-1h", "1y", "2 hours", ""])
def test_bad_duration_is_a_usage_error(seeded, duration):
    result = run("reap", f"--older-than={duration}", url=seeded)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "invalid duration" in result.stderr


@pytest.mark.parametrize("now", ["9999-12-31", "2026-07-14T12:00:00Z"])
def test_reap_takes_no_moment_from_the_command_line(seeded, now):
    """``--now`` let anyone with the CLI charge running tasks' reservations early."""
    result = run("reap", "--now", now, url=seeded)
    assert result.returncode == 2 and "unrecognized arguments: --now" in result.stderr
    ledger = open_ledger(seeded)
    assert len(ledger.open_reservations()) == 1
    ledger.close()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("status", "--offset", "1e30"), "--offset: expected a whole number"),
        (("status", "--limit", "99999999999999999999"), "--limit: expected a number up to"),
        (("history", "--after", "99999999999999999999"), "--after: expected a number up to"),
        (("reap", "--older-than", "99999999999999d"), "is too long"),
        (("policy", "set", "--epsilon", "-1"), "--epsilon: expected a number > 0"),
        (("policy", "set", "--epsilon", "nan"), "--epsilon: expected a finite number"),
        (("policy", "set", "--epsilon", "2", "--grace", "99999999999999d"), "is too long"),
        (("init", "--epsilon", "inf", "--delta", "1e-5"), "--epsilon: expected a finite"),
    ],
)
def test_out_of_range_values_are_usage_errors_naming_the_option(seeded, capsys, args, says):
    code, out, err = call(capsys, "--url", seeded, *args)
    assert code == 2 and says in err and "Traceback" not in err, (code, err)


def test_a_reap_cutoff_before_the_first_moment_reaps_nothing(seeded, capsys, monkeypatch):
    monkeypatch.setattr(ledger_clock, "now", lambda: datetime(1, 1, 1, tzinfo=UTC))
    code, out, err = call(capsys, "--url", seeded, "reap", "--older-than", "1h")
    assert code == 0, err
    assert out == "no open reservation's lease has run out and none is older than 1:00:00\n"


def test_version(capsys):
    code, out, _ = call(capsys, "--version")
    assert code == 0 and out.strip() == f"dp-budget {__version__}"


def test_the_last_page_of_status_says_which_rows_it_shows(seeded, capsys):
    code, out, _ = call(capsys, "--url", seeded, "status", "--limit", "2", "--offset", "2")
    assert code == 0
    assert out.splitlines()[-1] == "showing 3-4 of 4 account(s)"


def test_duration_parsing():
    assert parse_duration("2h") == timedelta(hours=2)
    assert parse_duration("30m") == timedelta(minutes=30)
    assert parse_duration("1d") == timedelta(days=1)
    assert parse_duration("1h30m") == timedelta(minutes=90)
    assert parse_duration("0s") == timedelta(0)


# ---------------------------------------------------------------------- policy


def test_policy_list_and_set(seeded):
    listed = run("policy", "list", url=seeded)
    assert listed.returncode == 0, listed.stderr
    header, rows = table(listed.stdout)
    assert header.split()[:3] == ["TENANT", "QUERY", "TYPE"]
    assert [row.split()[:2] for row in rows] == [["*", "*"], ["acme", "*"]]
    assert rows[1].endswith(CLAUSE)

    # acme/count has been charged in ISO weeks: another calendar is refused, audited nothing.
    refused = run(
        "policy", "set", "--tenant", "acme", "--query-type", "count", "--epsilon", "1.5",
        "--calendar", "day", url=seeded,
    )  # fmt: skip
    assert_one_line_error(refused)
    assert "second set of windows" in refused.stderr
    result = run(
        "policy", "set", "--tenant", "acme", "--query-type", "count", "--epsilon", "1.5",
        "--warn-fraction", "0.5", "--grace", "1d", "--clause", "contract 7 s.2",
        url=seeded,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "policy acme/count created" in result.stdout
    ledger = open_ledger(seeded)
    policy = ledger.policy_for(DAVE)
    assert (policy.cap_epsilon, policy.warn_fraction, policy.calendar.kind) == (
        1.5,
        0.5,
        "iso_week",
    )
    assert policy.grace == timedelta(days=1)
    assert policy.compliance_clause == "contract 7 s.2"
    assert ledger.history()[-1]["action"] == "policy"
    assert [e["action"] for e in ledger.history()].count("policy") == 3
    ledger.close()


def test_policy_set_keeps_what_is_not_given(seeded, capsys):
    code, out, _ = call(
        capsys, "--url", seeded, "policy", "set", "--tenant", "acme", "--epsilon", "2.5"
    )
    assert code == 0 and "policy acme/* updated" in out
    ledger = open_ledger(seeded)
    policy = ledger.policy_for(DAVE)
    ledger.close()
    assert policy.cap_epsilon == 2.5 and policy.compliance_clause == CLAUSE


@pytest.mark.parametrize(
    "args",
    [
        ("--epsilon", "2", "--calendar", "fixed"),  # no length
        ("--epsilon", "2", "--calendar", "fixed", "--length-seconds", "3600"),  # < min window
        ("--epsilon", "2", "--tenant", " "),
    ],
)
def test_policy_set_rejects_invalid_policies(seeded, args):
    """Values only the policy can judge: one error line, exit 2 (--epsilon -1 is refused
    by the parser, in test_out_of_range_values_are_usage_errors_naming_the_option)."""
    result = run("policy", "set", *args, url=seeded)
    assert_one_line_error(result)
    assert result.returncode == 2


def test_policy_set_caps_across_query_types_and_windows(seeded, capsys):
    for extra in (
        ("--across", "query_types", "--epsilon", "4"),
        ("--across", "windows", "--horizon-windows", "52", "--epsilon", "12"),
    ):
        code, out, err = call(capsys, "--url", seeded, "policy", "set", "--tenant", "acme", *extra)
        assert code == 0, err
    assert "policy acme/*across windows created" in out and "52 per period" in out
    # A change of its cap keeps the horizon; a release of dave's is charged to the totals.
    code, out, err = call(
        capsys, "--url", seeded, "policy", "set", "--tenant", "acme", "--across", "windows",
        "--epsilon", "10",
    )  # fmt: skip
    assert code == 0 and "52 per period" in out, err
    code, out, _ = call(capsys, "--url", seeded, "policy", "list")
    assert "*across query types" in out and "iso_week, 52 per period" in out
    ledger = open_ledger(seeded)
    with charging(OPEN_WINDOW):
        ledger.spend(key_for("dave", "heatmap", OPEN_WINDOW, tenant="acme"), GaussianMechanism(4.0))
    ledger.close()
    code, out, _ = call(capsys, "--url", seeded, "status", "--subject", "Dave")
    rows = [line.split() for line in out.splitlines() if line.startswith("acme ")]
    assert code == 0 and [row[2] for row in rows] == ["*across", "*across", "count", "heatmap"]
    assert "4 account(s)" in out


def test_policy_set_divides_a_cap_among_principals(seeded, capsys):
    code, out, err = call(
        capsys, "--url", seeded, "policy", "set", "--tenant", "acme", "--across", "query_types",
        "--epsilon", "4", "--filter-order", "auto", "--share", "analytics=0.6:etl_a,etl_b",
        "--share", "growth=0.4:etl_g",
    )  # fmt: skip
    assert code == 0, err
    assert "share analytics: 0.6 of the budget" in out and "DAGs etl_a, etl_b" in out
    code, out, _ = call(capsys, "--url", seeded, "policy", "list")
    assert "analytics=0.6 growth=0.4" in out
    # A change of its cap keeps the shares (recomputed); --no-shares undivides it.
    code, out, err = call(
        capsys, "--url", seeded, "policy", "set", "--tenant", "acme", "--across", "query_types",
        "--epsilon", "5",
    )  # fmt: skip
    assert code == 0 and "share growth: 0.4" in out, err
    ledger = open_ledger(seeded)
    shares = ledger.policy_for_scope("acme", "*across query types").shares
    assert [s.principal for s in shares] == ["analytics", "growth"]
    assert all(s.cap_epsilon is not None and s.cap_epsilon < 5 for s in shares)
    ledger.close()
    code, out, err = call(
        capsys, "--url", seeded, "policy", "set", "--tenant", "acme", "--across", "query_types",
        "--no-shares",
    )  # fmt: skip
    assert code == 0 and "share" not in out, err


@pytest.mark.parametrize(
    "share",
    ["analytics", "analytics=0.5", "analytics=2:etl_a", "Ana=0.5:etl_a", "a=0.5:bad/dag"],
)
def test_policy_set_refuses_a_share_spelled_wrong(seeded, share):
    result = run(
        "policy", "set", "--tenant", "acme", "--across", "query_types", "--epsilon", "3",
        "--filter-order", "auto", "--share", share, url=seeded,
    )  # fmt: skip
    assert result.returncode == 2 and "argument --share:" in result.stderr


def test_policy_set_refuses_shares_beyond_the_cap(seeded):
    result = run(
        "policy", "set", "--tenant", "acme", "--across", "query_types", "--epsilon", "3",
        "--filter-order", "auto", "--share", "a=0.6:x", "--share", "b=0.6:y", url=seeded,
    )  # fmt: skip
    assert_one_line_error(result)
    assert result.returncode == 2 and "at most 1" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--across", "windows"), "--horizon-windows"),
        (("--across", "query_types", "--query-type", "count"), "no --query-type"),
        (("--horizon-windows", "4"), "--across windows"),
    ],
)
def test_policy_set_refuses_a_scope_spelled_wrong(seeded, args, message):
    result = run("policy", "set", "--tenant", "acme", "--epsilon", "3", *args, url=seeded)
    assert_one_line_error(result)
    assert result.returncode == 2 and message in result.stderr


def test_policy_set_fixed_calendar(seeded, capsys):
    code, out, err = call(
        capsys, "--url", seeded, "policy", "set", "--query-type", "count", "--epsilon", "1",
        "--calendar", "fixed", "--length-seconds", "3600", "--min-window-seconds", "3600",
    )  # fmt: skip
    assert code == 0, err
    code, out, _ = call(capsys, "--url", seeded, "policy", "list")
    assert "fixed (3600s)" in out


# ---------------------------------------------------------------------- report


def test_report_json(seeded_any):
    result = run("report", "--format", "json", "--subjects", url=seeded_any)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    ledger = open_ledger(seeded_any)
    entries = ledger.history()
    ledger.close()
    spend_actions = {"reserve", "commit", "release", "reap", "correction", "rescope", "reset"}
    assert [r["seq"] for r in document["schedule"]] == [
        e["seq"] for e in entries if e["action"] in spend_actions
    ]
    first_commit = next(r for r in document["schedule"] if r["action"] == "commit")
    assert first_commit["mechanism"] == {"kind": "gaussian", "noise_multiplier": 4.0}
    assert first_commit["attempt_id"] == "heat/run1/1" and first_commit["count"] == 3
    assert document["conversion"]["name"] == "improved"
    assert document["conversion"]["formula"] and document["conversion"]["citation"]
    assert [c["reason"] for c in document["corrections"]] == ["missed release"]
    assert document["verification"]["ok"] is True
    assert document["code_version"]["version"] == __version__
    assert document["privacy_unit"]["unit"] == "subject"
    assert {a["subject"]: a["state"] for a in document["accounts"]} == {
        "alice": "ok",
        "bob": "WARNING",
        "erin": "EXHAUSTED",
        "dave": "ok",
    }
    assert CLAUSE in [p["compliance_clause"] for p in document["policies"]]


def test_report_markdown(seeded_any):
    result = run("report", "--format", "md", url=seeded_any)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("# Privacy report")
    for heading in ("## Guarantee per spend class", "## Release schedule", "## Corrections"):
        assert heading in out
    assert "**Verification: OK**" in out
    assert "missed release" in out and CLAUSE in out


def test_report_filters_and_reports_failed_verification(seeded, capsys):
    code, out, _ = call(
        capsys, "--url", seeded, "report", "--format", "json", "--tenant", "acme", "--subjects"
    )
    assert code == 0
    document = json.loads(out)
    assert [a["subject"] for a in document["accounts"]] == ["dave"]
    assert [r["action"] for r in document["schedule"]] == ["reserve"]

    engine = sa.create_engine(seeded)
    with engine.begin() as connection:
        connection.execute(sa.text("UPDATE dp_history SET actor = 'nobody' WHERE seq = 5"))
    engine.dispose()
    code, out, _ = call(capsys, "--url", seeded, "report")
    assert code == 0
    assert "**Verification: FAILED**" in out and "- entry 5:" in out


def test_verify_prints_its_notes(sqlite_url, capsys, monkeypatch):
    """A cost an earlier version priced lower is a note, not a failure: printed on stderr."""
    from dp_budget_provider.accounting import PureDPMechanism
    from dp_budget_provider.accounting import mechanisms as mechanisms_module
    from tests.ledger.releases.test_sound_costs import _old_pure_dp_rdp

    today = mechanisms_module._pure_dp_rdp
    monkeypatch.setattr(mechanisms_module, "_pure_dp_rdp_today", today, raising=False)
    monkeypatch.setattr(mechanisms_module, "_pure_dp_rdp", _old_pure_dp_rdp)
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=sqlite_url)
    with charging(CLOSED):
        ledger.spend(ALICE, PureDPMechanism(0.05), 10)
    ledger.close()
    monkeypatch.setattr(mechanisms_module, "_pure_dp_rdp", today)
    code, out, err = call(capsys, "--url", sqlite_url, "verify")
    assert code == 0 and out.startswith("OK:")
    assert "note:" in err and "earlier version's pricing" in err


def test_policy_set_changes_one_option_without_restating_the_cap(seeded, capsys):
    code, _, err = call(
        capsys, "--url", seeded, "policy", "set", "--tenant", "acme", "--warn-fraction", "0.5"
    )
    assert code == 0, err
    ledger = open_ledger(seeded)
    policy = next(p for p in ledger.policies() if p.scope == ("acme", "*"))
    ledger.close()
    assert (policy.cap_epsilon, policy.warn_fraction, policy.compliance_clause) == (
        2.0,
        0.5,
        CLAUSE,
    )
    code, _, err = call(
        capsys, "--url", seeded, "policy", "set", "--tenant", "globex", "--grace", "1d"
    )
    assert code == 2 and "give its cap with --epsilon" in err


def test_every_option_has_help():
    from dp_budget_provider.cli.parser import build_parser

    parser = build_parser()
    missing = []

    def walk(node, path):
        for action in node._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif action.help in (None, "") and action.dest not in ("help", "version"):
                missing.append(f"{path} {action.option_strings or action.dest}")

    walk(parser, "dp-budget")
    assert not missing, missing


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("policy", "set", "--epsilon", "2", "--length-seconds", "60"), "--length-seconds"),
        (("init", "--epsilon", "4", "--delta", "1e-5"), "`dp-budget policy set`"),
    ],
)
def test_errors_name_cli_options_not_python_names(seeded, capsys, args, option):
    code, _, err = call(capsys, "--url", seeded, *args)
    assert code in (1, 2) and option in err
    assert not any(name in err for name in ("length_seconds", "set_policy", "cap_epsilon"))


# ---------------------------------------------------------------------- window labels shown


FIXED_SHOWN = "2026-12-03T01:12:00Z+60s"


@pytest.fixture
def fixed_window(sqlite_url):
    """A release charged to a 60-second fixed window (stored as 2026-12-03t01:12:00z+60s)."""
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=sqlite_url)
    ledger.set_policy(
        Policy(
            3.0,
            query_type="stream",
            calendar=WindowCalendar("fixed", 60),
            min_window=timedelta(seconds=60),
        )
    )
    with charging(FIXED_SHOWN.lower()):  # charged while it was open, whatever the real clock
        ledger.spend(
            key_for("alice", "stream", FIXED_SHOWN), GaussianMechanism(4.0), attempt="s/1/1"
        )
    ledger.close()
    return sqlite_url


def test_fixed_window_labels_read_as_iso_8601_everywhere_people_see_them(fixed_window, capsys):
    lowercase = FIXED_SHOWN.lower()
    for command in (
        ("status",),
        ("classes",),
        ("show", "alice", "stream", lowercase),  # either case is accepted on input
        ("history",),
        ("report", "--format", "md", "--window", FIXED_SHOWN),
    ):
        code, out, err = call(capsys, "--url", fixed_window, *command)
        assert code == 0, (command, err)
        assert FIXED_SHOWN in out and lowercase not in out, (command, out)
    code, out, _ = call(capsys, "--url", fixed_window, "status", "--json")
    assert json.loads(out)["accounts"][0]["window"] == lowercase  # machines: as stored


def test_only_the_administrators_key_sets_a_policy_and_opens_a_refusal(
    capsys, sqlite_url, tmp_path, monkeypatch
):
    """keygen writes a key only its owner reads; `admin init` records it once and prints
    the connections' pin; without the key `policy set` and `quarantine clear` are refused
    (exit 1, naming the administrator key), with it they are audited; `refusal` opens a
    reference sealed to the key and nothing else."""
    monkeypatch.delenv("DP_BUDGET_ADMIN_KEY_FILE")
    path = tmp_path / "admin.key"
    code, out, _ = call(capsys, "admin", "keygen", "--out", str(path))
    assert code == 0 and (path.stat().st_mode & 0o777) == 0o600
    public = out.split("public key: ", 1)[1].strip()
    assert call(capsys, "admin", "keygen", "--out", str(path))[0] == 1  # never overwritten
    assert call(capsys, "--url", sqlite_url, "init", "--epsilon", "3", "--delta", "1e-5")[0] == 0
    code, _, err = call(capsys, "--url", sqlite_url, "policy", "set", "--epsilon", "9")
    assert code == 1 and "no administrator key yet" in err
    code, out, _ = call(capsys, "--url", sqlite_url, "--admin-key", str(path), "admin", "init")
    assert code == 0 and json.loads(out.splitlines()[-1]) == {"admin_public_key": public}
    code, _, err = call(capsys, "--url", sqlite_url, "policy", "set", "--epsilon", "9")
    assert code == 1 and "administrator's act" in err and "--admin-key" in err
    monkeypatch.setenv("DP_BUDGET_ADMIN_KEY_FILE", str(path))
    assert call(capsys, "--url", sqlite_url, "policy", "set", "--epsilon", "9")[0] == 0
    admin = AdminKey.load(path)
    reference = admin.public.seal({"refusal": "BudgetExhausted", "account": "x"})
    code, out, _ = call(capsys, "refusal", reference)
    assert code == 0 and json.loads(out)["refusal"] == "BudgetExhausted"
    other = AdminKey.generate().public.seal({"refusal": "BudgetExhausted"})
    code, _, err = call(capsys, "refusal", other)
    assert code == 2 and "not sealed to this admin key" in err
    path.chmod(0o644)
    code, _, err = call(capsys, "refusal", reference)
    assert code == 2 and "chmod 600" in err


def test_a_sealed_windows_final_spend_in_status_classes_and_report(ledger_url, capsys, monkeypatch):
    """After the reset, status, classes and report of the sealed week read each subject's
    final spend, state SEALED (not "no accounts"); the report lists subjects on request,
    one page at a time."""
    monkeypatch.setattr(ledger_clock, "now", lambda: datetime(2026, 7, 8, tzinfo=timezone.utc))
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=ledger_url)
    cohort = ledger.cohort([f"u{i:03d}" for i in range(300)], tenant="acme")
    ledger.commit(ledger.reserve(cohort.in_window("heatmap", "2026-w28"), GaussianMechanism(3.0)))
    final = ledger.epsilon_of(key_for("u007", "heatmap", "2026-w28", tenant="acme"))
    monkeypatch.setattr(ledger_clock, "now", lambda: datetime(2026, 8, 8, tzinfo=timezone.utc))
    ledger.reset("2026-w28")
    ledger.close()
    code, out, _ = call(capsys, "--url", ledger_url, "status", "--json")
    assert code == 0 and json.loads(out)["accounts"] == []
    code, out, _ = call(capsys, "--url", ledger_url, "status", "--window", "2026-W28", "--json")
    document = json.loads(out)
    assert code == 0 and document["total"] == 300
    assert {a["state"] for a in document["accounts"]} == {"SEALED"}
    assert document["accounts"][7]["epsilon"] == final
    code, out, _ = call(capsys, "--url", ledger_url, "status", "--sealed", "--limit", "1")
    assert code == 0 and "SEALED" in out and "showing 1-1 of 300" in out
    code, out, _ = call(capsys, "--url", ledger_url, "classes", "--window", "2026-W28", "--json")
    assert [(c["subjects"], c["state"]) for c in json.loads(out)["classes"]] == [(300, "SEALED")]
    code, out, _ = call(capsys, "--url", ledger_url, "report", "--window", "2026-W28")
    assert code == 0 and "No live accounts" not in out and "SEALED" in out
    assert "Not listed: each of the 300 subjects" in out
    code, out, _ = call(
        capsys, "--url", ledger_url, "report", "--window", "2026-W28", "--subjects",
        "--page", "2", "--page-size", "100",
    )  # fmt: skip
    assert code == 0 and "Page 2 of 3" in out and "| u100 |" in out and "| u099 |" not in out
    code, _, err = call(capsys, "--url", ledger_url, "report", "--subjects", "--page", "4",
                        "--page-size", "100")  # fmt: skip
    assert code != 0 and "page 4 does not exist" in err


def test_status_warns_on_stderr_when_maintenance_is_overdue(sqlite_url, capsys, monkeypatch):
    """stdout stays the command's output (--json parses, with a maintenance field); the
    warning is one stderr line; the exit code is status's own."""
    AdminLedger(BudgetCap(3.0, DELTA), url=sqlite_url).close()
    code, out, err = call(capsys, "--url", sqlite_url, "status", "--json")
    assert code == 0 and err == ""
    assert [job["overdue"] for job in json.loads(out)["maintenance"]] == [False] * 3

    later = datetime.now(UTC) + timedelta(days=3)
    monkeypatch.setattr(ledger_clock, "now", lambda: later)
    code, out, err = call(capsys, "--url", sqlite_url, "status", "--json")
    assert code == 0
    jobs = {job["job"]: job for job in json.loads(out)["maintenance"]}
    assert [jobs[name]["overdue"] for name in ("reap", "reset", "verify")] == [True] * 3
    assert jobs["reap"]["last_run"] is None and jobs["reap"]["interval_seconds"] == 300
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dp-budget: warning: ledger maintenance overdue")
    assert "reap has never run" in lines[0] and "reset has never run" in lines[0]

    assert call(capsys, "--url", sqlite_url, "reap")[0] == 0
    code, out, err = call(capsys, "--url", sqlite_url, "status")
    assert code == 0 and "no accounts" in out and "overdue" not in out
    assert "reap" not in err and "reset has never run" in err
