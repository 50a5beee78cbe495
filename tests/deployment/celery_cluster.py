"""A real Airflow 3 deployment on the CeleryExecutor, for tests: api-server, scheduler,
dag-processor and Celery workers, each its own OS process (group), on a PostgreSQL
metadata database and Redis as the Celery broker.

Every component gets the same configuration (docs/deploying.md, "Scaling out"); the workers
reach the ledger only through the ``dp_budget_default`` connection given here. Each
cluster has queues of its own, so clusters of concurrent test runs sharing one Redis
database never take each other's tasks. Every step has a timeout, and everything started
here is stopped afterwards, whole process trees included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from tests.plugins.airflow_server import (
    AIRFLOW,
    PASSWORDS_FILE,
    ROOT,
    START_TIMEOUT,
    _wait_until_healthy,
    free_port,
)

# Redis on this machine; a database number the other users of that Redis leave alone.
REDIS_URL = os.environ.get("DP_BUDGET_TEST_REDIS", "redis://127.0.0.1:6379/13")
TERMINAL = {"success", "failed"}
STOP_TIMEOUT = 5


def environment(
    home: Path,
    metadata_url: str,
    connection: dict[str, Any],
    queue: str,
    port: int,
    **settings: str,
) -> dict[str, str]:
    """What every component of the cluster runs with (``settings``: more ``AIRFLOW__...``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(home / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
        AIRFLOW__CORE__EXECUTOR="CeleryExecutor",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=metadata_url,
        AIRFLOW__CELERY__BROKER_URL=REDIS_URL,
        AIRFLOW__CELERY__RESULT_BACKEND=f"db+{metadata_url}",
        AIRFLOW__OPERATORS__DEFAULT_QUEUE=queue,
        # Celery workers run tasks that call back into the api-server's execution API.
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
        AIRFLOW__API__HOST="127.0.0.1",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{port}",
        # One signing key for every component: the scheduler signs the task's token and the
        # api-server checks it.
        AIRFLOW__API_AUTH__JWT_SECRET=os.urandom(48).hex(),
        AIRFLOW__API__SECRET_KEY=os.urandom(24).hex(),
        AIRFLOW__CORE__AUTH_MANAGER=(
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
        ),
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="admin:admin",
        AIRFLOW__LOGGING__LOGGING_LEVEL="INFO",
        # A worker whose call to the execution API times out retries it; a retried "start
        # running" that the busy server had already applied is then refused (409) and the
        # task fails. Small machines running a whole cluster need more than the 5 s default.
        AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT="30",
        AIRFLOW_CONN_DP_BUDGET_DEFAULT=json.dumps(connection),
    )
    env.update(settings)
    return env


@dataclass
class Cluster:
    url: str
    home: Path
    queue: str  # the default queue; ``queue_named(name)`` for others
    env: dict[str, str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)
    migration: subprocess.Popen | None = None
    _token: str = ""

    def queue_named(self, name: str) -> str:
        """The cluster's own name of queue ``name`` (``"default"``: the default queue)."""
        return self.queue if name == "default" else f"{self.queue}-{name}"

    def migrate(self) -> None:
        """Start ``airflow db migrate`` (awaited by :func:`running`): it takes a while."""
        self.migration = subprocess.Popen(
            [str(AIRFLOW), "db", "migrate"],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        """A call of the REST API (``/api/v2`` + ``path``) as the admin user; its JSON."""
        if not self._token:
            password = json.loads((self.home / PASSWORDS_FILE).read_text())["admin"]
            response = httpx.post(
                f"{self.url}/auth/token",
                json={"username": "admin", "password": password},
                timeout=30,
            )
            response.raise_for_status()
            self._token = response.json()["access_token"]
        response = httpx.request(
            method,
            f"{self.url}/api/v2{path}",
            headers={"Authorization": f"Bearer {self._token}"},
            timeout=30,
            **kwargs,
        )
        response.raise_for_status()
        return response.json()

    def wait_for_dags(self, dag_ids: list[str], timeout: float = START_TIMEOUT) -> None:
        """Until the dag-processor has parsed every one of ``dag_ids``."""
        deadline = time.monotonic() + timeout
        missing = set(dag_ids)
        while missing:
            self.check_alive()
            found = {d["dag_id"] for d in self.api("GET", "/dags", params={"limit": 100})["dags"]}
            missing -= found
            if missing and time.monotonic() > deadline:
                raise RuntimeError(f"DAGs not parsed after {timeout}s: {sorted(missing)}")
            time.sleep(0.3)

    def trigger(self, dag_id: str) -> str:
        """A manual run of ``dag_id``, now; its run id."""
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None})
        return run["dag_run_id"]

    def first_run(self, dag_id: str, timeout: float) -> str:
        """The id of ``dag_id``'s first run, once the scheduler has created it."""
        deadline = time.monotonic() + timeout
        while True:
            runs = self.api("GET", f"/dags/{dag_id}/dagRuns", params={"limit": 1})["dag_runs"]
            if runs:
                return runs[0]["dag_run_id"]
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"no run of {dag_id} after {timeout}s")
            time.sleep(0.3)

    def task_state(self, dag_id: str, run_id: str, task_id: str) -> str | None:
        path = f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"
        return self.api("GET", path)["state"]

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float) -> str:
        """The final state of a run (success or failed)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]
            if state in TERMINAL:
                return state
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{dag_id} {run_id} still {state} after {timeout}s")
            time.sleep(0.3)

    def check_alive(self) -> None:
        """Fail, with its log, if a component died that nobody killed."""
        for name, process in self.processes.items():
            if process.poll() is not None and name not in self.killed:
                log = (self.home / f"{name}.log").read_text()[-4000:]
                raise RuntimeError(f"{name} exited ({process.returncode}):\n{log}")

    def kill(self, name: str) -> list[int]:
        """SIGKILL a component as a machine loss would: its process group and the groups
        of all its descendants (Airflow runs each task in a process group of its own, so
        killing the worker's group alone would leave the task running). Its pids."""
        self.killed.add(name)
        return _kill_tree(self.processes[name].pid)

    def logs(self) -> dict[Path, str]:
        """Every log of the cluster: the components' and the tasks'."""
        files = [*self.home.glob("*.log"), *(self.home / "logs").rglob("*.log")]
        return {path: path.read_text(errors="replace") for path in files if path.is_file()}


def cluster_for(
    home: Path, metadata_url: str, connection: dict[str, Any], **settings: str
) -> Cluster:
    """A cluster's configuration on ``home`` (nothing started yet)."""
    port = free_port()
    queue = f"dpb-{uuid.uuid4().hex[:10]}"
    env = environment(home, metadata_url, connection, queue, port, **settings)
    return Cluster(f"http://127.0.0.1:{port}", home, queue, env)


def _tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (none if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_groups(tree: list[psutil.Process], sig: signal.Signals) -> None:
    """``sig`` to every process group of ``tree`` (never to this test's own group)."""
    groups = set()
    for process in tree:
        with suppress(ProcessLookupError):
            groups.add(os.getpgid(process.pid))
    groups.discard(os.getpgid(0))
    for group in groups:
        with suppress(ProcessLookupError):
            os.killpg(group, sig)


def _kill_tree(pid: int) -> list[int]:
    tree = _tree(pid)
    _signal_groups(tree, signal.SIGKILL)
    psutil.wait_procs(tree, timeout=30)
    return [process.pid for process in tree]


def _stop(processes: list[subprocess.Popen]) -> None:
    """TERM the components' trees, then KILL whatever is left of them after a few seconds
    (nothing of a test's cluster needs a graceful shutdown)."""
    trees = [process for p in processes for process in _tree(p.pid)]
    _signal_groups(trees, signal.SIGTERM)
    _gone, alive = psutil.wait_procs(trees, timeout=STOP_TIMEOUT)
    _signal_groups(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=30)
    for process in processes:
        process.wait(timeout=30)


def _start(cluster: Cluster, name: str, args: list[str]) -> None:
    with (cluster.home / f"{name}.log").open("w") as output:
        cluster.processes[name] = subprocess.Popen(
            [str(AIRFLOW), *args],
            env=cluster.env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@contextmanager
def running(cluster: Cluster, workers: dict[str, tuple[list[str], int]]) -> Iterator[Cluster]:
    """Start the cluster (its ``dags`` folder already written) once its metadata database
    is migrated; ``workers`` maps each Celery worker's name to the queues it serves and
    its concurrency (task slots). Every component is stopped afterwards."""
    if cluster.migration is None:
        cluster.migrate()
    assert cluster.migration is not None
    if cluster.migration.wait(timeout=300) != 0:
        output = cluster.migration.stdout.read() if cluster.migration.stdout else ""
        raise RuntimeError(f"airflow db migrate failed:\n{output[-4000:]}")
    port = cluster.env["AIRFLOW__API__PORT"]
    try:
        # One uvicorn worker (the default is 4): the machines running the tests are small.
        _start(
            cluster, "api-server", ["api-server", "--host", "127.0.0.1", "--port", port, "-w", "1"]
        )
        _start(cluster, "scheduler", ["scheduler"])
        _start(cluster, "dag-processor", ["dag-processor"])
        for name, (queues, concurrency) in workers.items():
            served = ",".join(cluster.queue_named(queue) for queue in queues)
            _start(
                cluster,
                name,
                ["celery", "worker", "--celery-hostname", f"{name}-{cluster.queue}@%h"]
                + ["--queues", served, "--concurrency", str(concurrency), "--skip-serve-logs"]
                + ["--without-mingle", "--without-gossip"],
            )
        _wait_until_healthy(
            cluster.processes["api-server"], cluster.url, cluster.home / "api-server.log"
        )
        yield cluster
    finally:
        _stop(list(cluster.processes.values()))
        _forget_queues(cluster.queue)


def _forget_queues(prefix: str) -> None:
    """Delete what the cluster left in Redis: its queues' keys and its unacknowledged
    messages (a killed worker's), which would otherwise be kept in the shared database."""
    broker = redis.Redis.from_url(REDIS_URL)
    try:
        for key in broker.scan_iter(match=f"*{prefix}*"):
            broker.delete(key)
        for tag, message in broker.hscan_iter("unacked"):
            if json.loads(message)[2].startswith(prefix):  # [payload, exchange, routing key]
                broker.hdel("unacked", tag)
                broker.zrem("unacked_index", tag)
    finally:
        broker.close()
