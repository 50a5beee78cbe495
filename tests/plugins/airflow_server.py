"""A real Airflow API server with the provider installed, for the end-to-end UI tests.

Its own AIRFLOW_HOME, metadata database (SQLite) and ledger (SQLite). The ledger is
seeded by running the example DAG with ``dag.test()`` in a subprocess (the session's
Airflow configuration belongs to another home), on the real clock: the runs charge the
current week (``tests/ledger_time.py``). The server runs in its own process
group, so stopping it stops its workers too. Every step has a timeout.

Two users, ``admin`` (role ADMIN) and ``viewer`` (role VIEWER). Only the api-server holds
the administrator's key (``[dp_budget] admin_key_file``, a copy of the tests' key in its
home, :attr:`Server.key_file`), as a deployment has it; the seeding's DAG runs do not.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.admin import ADMIN, admin_key_file
from tests.ledger_time import this_week

ROOT = Path(__file__).resolve().parents[2]
AIRFLOW = Path(sys.executable).with_name("airflow")
START_TIMEOUT = 180
STEP_TIMEOUT = 300
PASSWORDS_FILE = "simple_auth_manager_passwords.json.generated"  # SimpleAuthManager writes it
USERS = "admin:admin,viewer:viewer"  # [core] simple_auth_manager_users: name:role
# The ledger is keyed, its key in the connection as docs/deploying.md deploys it. The
# connection is in the environment (the seeding's DAG runs read it there) and, the same, in
# the metadata database, where the connections API shows it.
CHAIN_KEY = "ui-server-chain-key-0123456789abcdef"
CONNECTION = {"conn_type": "dpbudget"}


def extra(ledger_url: str) -> dict[str, str]:
    """The connection's extra: the ledger, its chain key and the administrator key it pins."""
    return {
        "url": ledger_url,
        "chain_key_secret": CHAIN_KEY,
        "admin_public_key": ADMIN.public.text,
    }


SEED = """
import importlib.util, json, sys
from pathlib import Path

dags = Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("example_dp_heatmap", dags / "example_dp_heatmap.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.hooks.dp_budget import DPBudgetHook, default_cap
from dp_budget_provider.ledger import AdminKey, Policy, PrivacyBudgetLedger, key_for

# The administrator creates the ledger with its key (docs/deploying.md, step 4).
hook = DPBudgetHook()
ledger = PrivacyBudgetLedger(
    default_cap(), url=hook.ledger_url(), chain_key=hook.chain_key(),
    admin=AdminKey.load(sys.argv[2]),
)
ledger.set_policy(Policy(2.0, tenant="acme", compliance_clause="GDPR Art. 25 (data "
                  "minimisation): at most eps = 2 per subject and week"))
runs = []
# The runs charge this week (sys.argv[3]): the run's own data interval is last week, which
# takes no new release once its grace period is over (from Thursday on). Each asks for a
# fresh release (a re-run of the same release would be handed the first one's answer).
for tenant in ("acme", "acme", "acme", "globex"):
    run = module.dag.test(run_conf={"tenant": tenant, "window": sys.argv[3], "refresh": True})
    runs.append({"run_id": run.run_id, "state": str(run.state), "tenant": tenant})
window = ledger.accounts(tenant="acme", limit=1)[0].key.window
# a release in flight on one account (its worker has reserved, not yet committed)
ledger.reserve([key_for("user-007", "heatmap", window, tenant="acme")],
               GaussianMechanism(8.0), attempt="example_dp_heatmap/release_heatmap/in_flight/-1/1")
# a subject id that is markup: it must show as text
ledger.spend(key_for("<script>alert(1)</script>", "count", window, tenant="globex"),
             {"kind": "laplace", "epsilon0": 0.5}, attempt="counts/count/manual__1/-1/1")
print(json.dumps({"runs": runs, "window": window}))
"""


@dataclass
class Server:
    url: str
    home: Path
    passwords: dict[str, str]  # of each user
    runs: list[dict[str, str]]
    window: str
    log: Path
    added: str  # what `airflow connections add` printed
    key_file: Path  # the administrator's key, on the api-server only

    @property
    def password(self) -> str:
        return self.passwords["admin"]

    @property
    def ledger_url(self) -> str:
        return f"sqlite:///{self.home / 'dp_budget_ledger.db'}"

    def token(self, user: str = "admin") -> str:
        response = httpx.post(
            f"{self.url}/auth/token",
            json={"username": user, "password": self.passwords[user]},
            timeout=30,
        )
        response.raise_for_status()
        return response.json()["access_token"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _environment(home: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    # The server and the seeding must import this checkout's package, whichever one the
    # virtualenv has installed in editable mode.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    ledger_url = f"sqlite:///{home / 'dp_budget_ledger.db'}"
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(home / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        # provider plugins load only when providers are discovered eagerly
        AIRFLOW__CORE__AUTH_MANAGER=(
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
        ),
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS=USERS,
        AIRFLOW__API__HOST="127.0.0.1",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{port}",
        AIRFLOW__API_AUTH__JWT_SECRET=os.urandom(48).hex(),
        AIRFLOW__LOGGING__LOGGING_LEVEL="WARNING",
        AIRFLOW_CONN_DP_BUDGET_DEFAULT=json.dumps(CONNECTION | {"extra": extra(ledger_url)}),
    )
    return env


def _run(args: list[str], env: dict[str, str], what: str) -> str:
    result = subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def _wait_until_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"api-server exited ({process.returncode}):\n{log.read_text()[-4000:]}"
            )
        try:
            if httpx.get(f"{url}/api/v2/monitor/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"api-server not healthy after {START_TIMEOUT}s:\n{log.read_text()[-4000:]}")


def _stop(process: subprocess.Popen) -> None:
    """Stop the server's process group (it started it: start_new_session)."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@contextmanager
def airflow_api_server(home: Path) -> Iterator[Server]:
    """Migrate, seed with the example DAG, start ``airflow api-server``; always stopped after."""
    port = free_port()
    env = _environment(home, port)
    (home / "dags").mkdir(parents=True)
    dag_file = home / "dags" / "example_dp_heatmap.py"
    dag_file.write_text((ROOT / "dags" / "example_dp_heatmap.py").read_text())
    _run([str(AIRFLOW), "db", "migrate"], env, "airflow db migrate")
    added = _run(
        [str(AIRFLOW), "connections", "add", "dp_budget_default"]
        + ["--conn-type", CONNECTION["conn_type"]]
        + ["--conn-extra", json.dumps(extra(f"sqlite:///{home / 'dp_budget_ledger.db'}"))],
        env,
        "airflow connections add",
    )
    seeded = json.loads(
        _run(
            [sys.executable, "-c", SEED, str(home / "dags"), str(admin_key_file()), this_week()],
            env,
            "seeding",
        ).splitlines()[-1]
    )
    key_file = home / "admin-key" / "admin.key"
    key_file.parent.mkdir(mode=0o700)
    ADMIN.write(key_file)
    log = home / "api-server.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [str(AIRFLOW), "api-server", "--host", "127.0.0.1", "--port", str(port), "-w", "1"],
            env=env | {"AIRFLOW__DP_BUDGET__ADMIN_KEY_FILE": str(key_file)},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_healthy(process, url, log)
        passwords = json.loads((home / PASSWORDS_FILE).read_text())
        yield Server(url, home, passwords, seeded["runs"], seeded["window"], log, added, key_file)
    finally:
        _stop(process)
