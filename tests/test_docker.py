"""Static checks of the Docker deployment in ``docker/``.

Docker does not run on the build machines, so these tests read the compose file and the
Dockerfile and check everything that can be checked without a daemon: the services and
their wiring, that every path they name exists in the repository, that every command
names a real ``airflow`` / ``dp-budget`` subcommand with real options (asked of the
installed CLIs themselves), and that the ledger connection is one the hook accepts.

Each check returns a list of problems; ``test_the_checks_catch_broken_deployments`` feeds
them broken inputs so a check that can never fail is itself caught.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import make_url

from dp_budget_provider.get_provider_info import get_provider_info
from dp_budget_provider.hooks.dp_budget import DPBudgetHook

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
COMPOSE_FILE = DOCKER / "docker-compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
BIN = Path(sys.executable).parent
CLIS = {"airflow", "dp-budget"}

BASE_IMAGE = "apache/airflow:3.3.2"
BASE_AIRFLOW_SERVICES = {
    "airflow-init",
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
}
# Services of a profile (started only with `--profile NAME`): the Celery deployment.
PROFILES = {"redis": {"celery"}, "airflow-worker": {"celery"}, "flower": {"flower"}}
AIRFLOW_SERVICES = BASE_AIRFLOW_SERVICES | {"airflow-worker", "flower"}
SERVICES = {"postgres", "ledger-db", "redis"} | AIRFLOW_SERVICES
REQUIRED_INVOCATIONS = {
    ("airflow", "db", "migrate"),
    ("airflow", "api-server"),
    ("airflow", "scheduler"),
    ("airflow", "dag-processor"),
    ("airflow", "triggerer"),
    ("airflow", "celery", "worker"),
    ("dp-budget", "db", "upgrade"),
    ("dp-budget", "init"),
}
SHELL_OPERATORS = {";", "&&", "||", "|", "&"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}

# ---------------------------------------------------------------------- reading the files

_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_]\w*)")


def interpolate(value: Any, variables: dict[str, str] | None = None) -> Any:
    """Compose's variable interpolation with only ``variables`` set (by default nothing):
    defaults apply to the others, ``$$`` is ``$``."""
    variables = variables or {}
    if isinstance(value, dict):
        return {key: interpolate(item, variables) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, variables) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        if variables.get(match.group(1) or match.group(4) or ""):
            return variables[match.group(1) or match.group(4)]
        operator, argument = match.group(2), match.group(3)
        if operator and operator.endswith("?"):
            raise ValueError(f"{match.group(0)} requires a variable to be set")
        return argument if operator else ""

    return _VARIABLE.sub(substitute, value)


def load_compose(text: str, variables: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(yaml.safe_load(text), variables)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(COMPOSE_FILE.read_text())


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def shell_lines(script: str) -> Iterator[list[str]]:
    """Each simple command of a shell script as tokens; heredoc bodies are skipped."""
    heredoc_end: str | None = None
    for line in script.replace("\\\n", " ").splitlines():
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        if match := re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line):
            heredoc_end = match.group(1)
            line = line[: match.start()]
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token not in SHELL_OPERATORS:
                command.append(token)
                continue
            while command and command[0] in {"exec", "/entrypoint"}:
                command = command[1:]
            if command:
                yield command
            command = []


def invocations(compose: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(where, tokens) of every airflow / dp-budget command the compose file runs."""
    found: list[tuple[str, list[str]]] = []
    for name, service in compose["services"].items():
        command = service.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        entrypoint = service.get("entrypoint")
        if isinstance(entrypoint, str):
            entrypoint = shlex.split(entrypoint)
        if command and not entrypoint and name in AIRFLOW_SERVICES:
            # The official image's entrypoint runs `airflow <command>`.
            found.append((f"{name}.command", ["airflow", *command]))
        elif entrypoint and Path(entrypoint[0]).name in {"bash", "sh"}:
            args = [*entrypoint[1:], *(command or [])]
            if "-c" in args:
                script = args[args.index("-c") + 1]
                found += [(f"{name}.command", t) for t in shell_lines(script) if t[0] in CLIS]
        test = (service.get("healthcheck") or {}).get("test") or []
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        if test[:1] == ["CMD-SHELL"]:
            found += [(f"{name}.healthcheck", t) for t in shell_lines(test[1]) if t[0] in CLIS]
        elif test[:1] == ["CMD"] and test[1] in CLIS:
            found.append((f"{name}.healthcheck", test[1:]))
    return found


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    result = []
    for line in joined.splitlines():
        if line.strip():
            instruction, _, arguments = line.strip().partition(" ")
            result.append((instruction.upper(), arguments.strip()))
    return result


# ---------------------------------------------------------------------- the CLIs


# Prints `airflow <path> --help` for each path of argv[1] (JSON), as (exit code, text): the
# installed CLI's own parser, started once instead of once per command.
_AIRFLOW_HELPS = """
import contextlib, io, json, sys
from airflow.cli import cli_parser
helps = {}
for path in json.loads(sys.argv[1]):
    text = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            cli_parser.get_parser().parse_args([*path, "--help"])
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
    helps[" ".join(path)] = [code, text.getvalue()]
print(json.dumps(helps))
"""


@cache
def _airflow_helps() -> dict[str, list[Any]]:
    """The help of every `airflow` command the compose file runs, and the top level."""
    compose = load_compose(COMPOSE_FILE.read_text())
    paths = [[]] + [split_arguments(t[1:])[0] for _, t in invocations(compose) if t[0] == "airflow"]
    result = subprocess.run(
        [sys.executable, "-c", _AIRFLOW_HELPS, json.dumps(paths)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@cache
def cli_help(program: str, *path: str) -> tuple[int, str]:
    if program == "airflow" and " ".join(path) in _airflow_helps():
        code, text = _airflow_helps()[" ".join(path)]
        return code, text
    result = subprocess.run(
        [str(BIN / program), *path, "--help"], capture_output=True, text=True, timeout=120
    )
    return result.returncode, result.stdout + result.stderr


def split_arguments(args: list[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
    """Subcommand path and (option, value) pairs. An option followed by a word takes it."""
    path: list[str] = []
    options: list[tuple[str, str | None]] = []
    index = 0
    while index < len(args):
        token = args[index]
        if token.startswith("-"):
            name, equals, value = token.partition("=")
            if equals:
                options.append((name, value))
            elif index + 1 < len(args) and not args[index + 1].startswith("-"):
                options.append((name, args[index + 1]))
                index += 1
            else:
                options.append((name, None))
        else:
            path.append(token)
        index += 1
    return path, options


def cli_problems(tokens: list[str]) -> list[str]:
    """Whether ``tokens`` is a real subcommand of the installed CLI with real options."""
    program, *args = tokens
    if program not in CLIS:
        return [f"{program!r} is not one of {sorted(CLIS)}"]
    path, options = split_arguments(args)
    code, text = cli_help(program, *path)
    if code != 0:
        return [f"`{program} {' '.join(path)}` is not a command: {text.strip()[-300:]}"]
    problems = []
    for name, value in options:
        helps = [text, cli_help(program)[1]]  # global options are listed at the top
        spec = next(
            (m for h in helps if (m := re.search(rf"(?m){re.escape(name)}\b( \S+)?", h))), None
        )
        if spec is None:
            problems.append(f"`{program} {' '.join(path)}` has no option {name}")
            continue
        metavar = (spec.group(1) or "").strip().strip("[]")
        if value is not None and not metavar:
            problems.append(f"{name} takes no value here, {value!r} would be a subcommand")
        choices = re.fullmatch(r"\{(.*)\}", metavar)
        if value is not None and choices and value not in choices.group(1).split(","):
            problems.append(f"{name} {value!r} is not one of {{{choices.group(1)}}}")
    return problems


# ---------------------------------------------------------------------- checks


def service_problems(compose: dict[str, Any]) -> list[str]:
    services = compose.get("services", {})
    problems = [f"no service {name!r}" for name in sorted(SERVICES - set(services))]
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {target: {"condition": "service_started"} for target in depends}
        for target, spec in depends.items():
            condition = (spec or {}).get("condition", "service_started")
            if target not in services:
                problems.append(f"{name} depends on unknown service {target!r}")
                continue
            if condition not in CONDITIONS:
                problems.append(f"{name} -> {target}: unknown condition {condition!r}")
            if condition == "service_healthy" and not services[target].get("healthcheck"):
                problems.append(f"{name} waits for {target} to be healthy; it has no healthcheck")
            if condition == "service_completed_successfully" and services[target].get(
                "restart"
            ) in {"always", "unless-stopped"}:
                problems.append(f"{name} waits for {target} to complete; it restarts forever")
    for name in AIRFLOW_SERVICES & set(services):
        depends = services[name].get("depends_on") or {}
        for database in ("postgres", "ledger-db"):
            if (depends.get(database) or {}).get("condition") != "service_healthy":
                problems.append(f"{name} must wait for {database} to be healthy")
        if (
            name != "airflow-init"
            and (depends.get("airflow-init") or {}).get("condition")
            != "service_completed_successfully"
        ):
            problems.append(f"{name} must wait for airflow-init to complete")
    return problems


def path_problems(compose: dict[str, Any], compose_dir: Path = DOCKER) -> list[str]:
    problems = []
    named = set(compose.get("volumes") or {})
    for name, service in compose.get("services", {}).items():
        build = service.get("build")
        if build is not None:
            build = {"context": build} if isinstance(build, str) else build
            context = (compose_dir / build.get("context", ".")).resolve()
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            if not context.is_dir():
                problems.append(f"{name}: build context {context} does not exist")
            if not dockerfile.is_file():
                problems.append(f"{name}: dockerfile {dockerfile} does not exist")
        for volume in service.get("volumes") or []:
            if isinstance(volume, dict):
                kind, source = volume.get("type", "volume"), volume.get("source", "")
            else:
                source = volume.split(":")[0]
                kind = "bind" if source.startswith((".", "/", "~")) else "volume"
            if kind == "bind" and not (compose_dir / source).resolve().exists():
                problems.append(f"{name}: host path {source} does not exist")
            if kind == "volume" and source and source not in named:
                problems.append(f"{name}: volume {source!r} is not declared")
    return problems


def ledger_problems(compose: dict[str, Any]) -> list[str]:
    services = compose["services"]
    ledger_env = environment(services["ledger-db"])
    problems = []
    for name in sorted(AIRFLOW_SERVICES):
        env = environment(services[name])
        raw = env.get("AIRFLOW_CONN_DP_BUDGET_DEFAULT")
        if raw is None:
            problems.append(f"{name}: AIRFLOW_CONN_DP_BUDGET_DEFAULT is not set")
            continue
        try:
            connection = json.loads(raw)
        except json.JSONDecodeError as error:
            problems.append(f"{name}: the ledger connection is not JSON: {error}")
            continue
        if connection.get("conn_type") != DPBudgetHook.conn_type:
            problems.append(f"{name}: conn_type {connection.get('conn_type')!r}")
        url = make_url((connection.get("extra") or {}).get("url", "sqlite://"))
        if url.get_backend_name() != "postgresql":
            problems.append(f"{name}: ledger URL {url} is not PostgreSQL")
        if url.host != "ledger-db":
            problems.append(f"{name}: ledger host {url.host!r} is not the ledger-db service")
        expected = (
            ledger_env.get("POSTGRES_USER"),
            ledger_env.get("POSTGRES_PASSWORD"),
            ledger_env.get("POSTGRES_DB"),
        )
        if (url.username, url.password, url.database) != expected:
            problems.append(f"{name}: ledger credentials/database do not match ledger-db's")
        cli_url = env.get("DP_BUDGET_URL")
        if cli_url is None or make_url(cli_url) != url:
            problems.append(f"{name}: DP_BUDGET_URL {cli_url!r} is not the connection's URL")
    return problems


def airflow_env_problems(compose: dict[str, Any]) -> list[str]:
    services = compose["services"]
    metadata_env = environment(services["postgres"])
    api_ports = {str(p).rsplit(":", 1)[-1] for p in services["airflow-apiserver"].get("ports", [])}
    options = get_provider_info()["config"]["dp_budget"]["options"]
    problems = []
    for name in sorted(AIRFLOW_SERVICES):
        env = environment(services[name])
        if env.get("AIRFLOW__CORE__EXECUTOR") != "LocalExecutor":
            problems.append(f"{name}: executor is {env.get('AIRFLOW__CORE__EXECUTOR')!r}")
        if env.get("AIRFLOW__CORE__LOAD_EXAMPLES", "").lower() != "false":
            problems.append(f"{name}: AIRFLOW__CORE__LOAD_EXAMPLES must be 'false'")
        metadata = make_url(env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "sqlite://"))
        if (metadata.host, metadata.username, metadata.password, metadata.database) != (
            "postgres",
            metadata_env.get("POSTGRES_USER"),
            metadata_env.get("POSTGRES_PASSWORD"),
            metadata_env.get("POSTGRES_DB"),
        ):
            problems.append(f"{name}: the metadata DB URL does not match the postgres service")
        execution = re.fullmatch(
            r"http://([\w-]+):(\d+)/execution/?",
            env.get("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", ""),
        )
        if not execution or execution.group(1) != "airflow-apiserver":
            problems.append(f"{name}: the execution API URL must name airflow-apiserver")
        elif execution.group(2) not in api_ports:
            problems.append(f"{name}: execution API port {execution.group(2)} is not served")
        if not env.get("AIRFLOW__API_AUTH__JWT_SECRET"):
            problems.append(f"{name}: no shared AIRFLOW__API_AUTH__JWT_SECRET")
        for variable in env:
            option = variable.removeprefix("AIRFLOW__DP_BUDGET__").lower()
            if variable.startswith("AIRFLOW__DP_BUDGET__") and option not in options:
                problems.append(f"{name}: {variable} is not a [dp_budget] option")
        if name == "airflow-init":
            problems += init_problems(services[name], env)
    return problems


def init_problems(init: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The ledger `init` agrees with the provider settings; the UI password file is shared."""
    problems = []
    commands = [t for where, t in invocations({"services": {"airflow-init": init}})]
    ledger_init = next((t for t in commands if t[:1] == ["dp-budget"] and "init" in t), None)
    if ledger_init is None:
        return ["airflow-init does not run `dp-budget init`"]
    options = dict(split_arguments(ledger_init[1:])[1])
    for option, setting in (
        ("--epsilon", "AIRFLOW__DP_BUDGET__DEFAULT_CAP_EPSILON"),
        ("--delta", "AIRFLOW__DP_BUDGET__DELTA"),
    ):
        if setting in env and float(options.get(option) or "nan") != float(env[setting]):
            problems.append(f"dp-budget init {option} {options.get(option)} != {setting}")
    passwords = env.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE")
    script = json.dumps(init.get("command"))
    if not passwords or "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE" not in script:
        problems.append("airflow-init does not write the simple auth manager's passwords file")
    return problems


def shared_mount_problems(compose: dict[str, Any], path: str, services: set[str]) -> list[str]:
    """``path``'s directory is a named volume in each of ``services``."""
    directory = str(Path(path).parent)
    problems = []
    for name in sorted(services):
        targets = {
            str(volume).split(":")[1]
            for volume in compose["services"][name].get("volumes") or []
            if not str(volume).startswith((".", "/", "~"))
        }
        if directory not in targets:
            problems.append(f"{name}: {directory} is not on a shared named volume")
    return problems


def profile_problems(compose: dict[str, Any]) -> list[str]:
    """The base deployment starts without any profile; the profiles add only their own
    services, and nothing outside a profile needs one of them."""
    services = compose.get("services", {})
    problems = []
    for name, service in services.items():
        profiles = set(service.get("profiles") or [])
        if profiles != PROFILES.get(name, set()):
            problems.append(
                f"{name}: profiles {sorted(profiles)}, not {sorted(PROFILES.get(name, set()))}"
            )
        if profiles:
            continue  # flower (its own profile) is started together with the celery one
        for target in service.get("depends_on") or {}:
            needed = set((services.get(target) or {}).get("profiles") or [])
            if needed:
                problems.append(
                    f"{name} needs {target}, which only the {sorted(needed)} profile starts"
                )
    return problems


def celery_problems(compose: dict[str, Any]) -> list[str]:
    """``compose`` read with AIRFLOW_EXECUTOR=CeleryExecutor: every Airflow component uses
    the CeleryExecutor, the broker is the redis service, results go to the metadata
    database, and the workers start after the broker and the execution API."""
    services = compose["services"]
    metadata_env = environment(services["postgres"])
    problems = []
    for name in sorted(AIRFLOW_SERVICES):
        env = environment(services[name])
        if env.get("AIRFLOW__CORE__EXECUTOR") != "CeleryExecutor":
            problems.append(f"{name}: executor is {env.get('AIRFLOW__CORE__EXECUTOR')!r}")
        broker = re.fullmatch(
            r"redis://([\w-]+):(\d+)/\d+", env.get("AIRFLOW__CELERY__BROKER_URL", "")
        )
        if not broker or broker.group(1) != "redis" or broker.group(2) != "6379":
            problems.append(f"{name}: the Celery broker is not the redis service")
        backend = make_url(
            env.get("AIRFLOW__CELERY__RESULT_BACKEND", "db+sqlite://").removeprefix("db+")
        )
        if (backend.host, backend.username, backend.password, backend.database) != (
            "postgres",
            metadata_env.get("POSTGRES_USER"),
            metadata_env.get("POSTGRES_PASSWORD"),
            metadata_env.get("POSTGRES_DB"),
        ):
            problems.append(f"{name}: the Celery result backend is not the metadata database")
    worker = services.get("airflow-worker") or {}
    depends = worker.get("depends_on") or {}
    for target in ("redis", "airflow-apiserver"):
        if (depends.get(target) or {}).get("condition") != "service_healthy":
            problems.append(f"airflow-worker must wait for {target} to be healthy")
    return problems


def dockerfile_problems(text: str, context: Path) -> list[str]:
    instructions = dockerfile_instructions(text)
    problems = []
    froms = [args for instruction, args in instructions if instruction == "FROM"]
    if froms[:1] != [BASE_IMAGE]:
        problems.append(f"base image is {froms[:1]}, not {BASE_IMAGE}")
    user = "airflow"  # the base image's own USER
    installed = copied_dags = False
    for instruction, args in instructions:
        if instruction == "USER":
            user = args.split(":")[0]
        if instruction in {"COPY", "ADD"}:
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            for source in words[:-1]:
                if not (context / source).exists():
                    problems.append(f"COPY source {source} does not exist in the build context")
            copied_dags |= words[:-1] == ["dags/"] and words[-1].rstrip("/") == "/opt/airflow/dags"
        if instruction == "RUN" and re.search(r"\bpip install\b", args):
            installed = True
            if user != "airflow":
                problems.append(f"pip install runs as {user!r}, not the airflow user")
            if "--no-cache-dir" not in args:
                problems.append("pip install without --no-cache-dir")
            if '"apache-airflow==${AIRFLOW_VERSION}"' not in args:
                problems.append("pip install does not pin apache-airflow to the image's version")
    if not installed:
        problems.append("the Dockerfile never pip-installs the project")
    if not copied_dags:
        problems.append("dags/ is not copied to /opt/airflow/dags")
    if user != "airflow":
        problems.append(f"the image ends as user {user!r}, not airflow")
    return problems


# ---------------------------------------------------------------------- tests


def test_services_and_their_dependencies(compose):
    assert service_problems(compose) == []


def test_build_and_volume_paths_exist_in_the_repository(compose):
    assert path_problems(compose) == []
    for name in AIRFLOW_SERVICES:
        service = compose["services"][name]
        assert (DOCKER / service["build"]["context"]).resolve() == REPO
        assert any(str(v).startswith("../dags:/opt/airflow/dags") for v in service["volumes"])


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param(
            tokens, id=f"{where}: {' '.join([tokens[0], *split_arguments(tokens[1:])[0]])}"
        )
        for where, tokens in invocations(load_compose(COMPOSE_FILE.read_text()))
    ],
)
def test_every_command_is_a_real_cli_subcommand(tokens):
    assert cli_problems(tokens) == []


def test_the_deployment_runs_every_component(compose):
    found = {(t[0], *split_arguments(t[1:])[0]) for _, t in invocations(compose)}
    assert found >= REQUIRED_INVOCATIONS, found


def test_ledger_connection_points_at_the_ledger_db_service(compose, monkeypatch):
    assert ledger_problems(compose) == []
    env = environment(compose["services"]["airflow-scheduler"])
    monkeypatch.setenv("AIRFLOW_CONN_DP_BUDGET_DEFAULT", env["AIRFLOW_CONN_DP_BUDGET_DEFAULT"])
    assert make_url(DPBudgetHook().ledger_url()) == make_url(env["DP_BUDGET_URL"])


def test_airflow_environment(compose):
    assert airflow_env_problems(compose) == []
    env = environment(compose["services"]["airflow-apiserver"])
    passwords = env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]
    assert shared_mount_problems(compose, passwords, {"airflow-init", "airflow-apiserver"}) == []


def test_the_celery_profile():
    assert profile_problems(load_compose(COMPOSE_FILE.read_text())) == []
    celery = load_compose(COMPOSE_FILE.read_text(), {"AIRFLOW_EXECUTOR": "CeleryExecutor"})
    assert celery_problems(celery) == []
    assert ledger_problems(celery) == []


def test_dockerfile():
    assert dockerfile_problems(DOCKERFILE.read_text(), REPO) == []


def assert_reported(problems: list[str], *expected: str) -> None:
    for text in expected:
        assert any(problem.startswith(text) for problem in problems), (text, problems)


def test_the_checks_catch_broken_deployments(compose):
    broken = copy.deepcopy(compose)
    services = broken["services"]
    del services["ledger-db"]["healthcheck"]
    services["airflow-triggerer"]["depends_on"]["memcached"] = {"condition": "service_healthy"}
    services["airflow-scheduler"]["volumes"] = ["../plugins:/opt/airflow/plugins", "nope:/x"]
    services["airflow-apiserver"]["build"] = {"context": "..", "dockerfile": "Dockerfile"}
    env = services["airflow-dag-processor"]["environment"]
    env["AIRFLOW_CONN_DP_BUDGET_DEFAULT"] = env["AIRFLOW_CONN_DP_BUDGET_DEFAULT"].replace(
        "@ledger-db", "@postgres"
    )
    env["AIRFLOW__DP_BUDGET__DEFAULT_CAP"] = "3"
    env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] = "http://localhost:8080/execution/"
    assert_reported(
        service_problems(broken),
        "airflow-triggerer depends on unknown service 'memcached'",
        "airflow-scheduler waits for ledger-db to be healthy; it has no healthcheck",
    )
    assert_reported(
        path_problems(broken),
        "airflow-scheduler: host path ../plugins does not exist",
        "airflow-scheduler: volume 'nope' is not declared",
        "airflow-apiserver: dockerfile",
    )
    assert_reported(
        ledger_problems(broken),
        "airflow-dag-processor: ledger host 'postgres' is not the ledger-db service",
        "airflow-dag-processor: DP_BUDGET_URL",
    )
    assert_reported(
        airflow_env_problems(broken),
        "airflow-dag-processor: AIRFLOW__DP_BUDGET__DEFAULT_CAP is not a [dp_budget] option",
        "airflow-dag-processor: the execution API URL must name airflow-apiserver",
    )

    celery = load_compose(COMPOSE_FILE.read_text(), {"AIRFLOW_EXECUTOR": "CeleryExecutor"})
    celery["services"]["airflow-worker"]["depends_on"].pop("redis")
    celery["services"]["redis"].pop("profiles")
    celery["services"]["airflow-scheduler"]["depends_on"]["airflow-worker"] = {
        "condition": "service_healthy"
    }
    celery["services"]["flower"]["environment"]["AIRFLOW__CELERY__BROKER_URL"] = "redis://x:6379/0"
    assert_reported(
        profile_problems(celery),
        "redis: profiles [], not ['celery']",
        "airflow-scheduler needs airflow-worker",
    )
    assert_reported(
        celery_problems(celery),
        "airflow-worker must wait for redis to be healthy",
        "flower: the Celery broker is not the redis service",
    )
    assert_reported(celery_problems(compose), "airflow-scheduler: executor is 'LocalExecutor'")

    assert cli_problems(["airflow", "webserver"])  # Airflow 2's UI command, gone in 3
    assert cli_problems(["airflow", "jobs", "check", "--job-type", "DagFileProcessorJob"])
    assert cli_problems(["dp-budget", "--url", "sqlite://", "init", "--cap", "3"])
    assert cli_problems(["airflow", "db", "migrate", "--no-such-flag"])

    dockerfile = DOCKERFILE.read_text()
    for wrong in (
        dockerfile.replace(BASE_IMAGE, "apache/airflow:2.10.5"),
        dockerfile.replace("COPY --chown=airflow:0 dags/", "COPY --chown=airflow:0 dag/"),
        dockerfile.replace("pip install --no-cache-dir", "pip install"),
        dockerfile.replace("USER airflow", "USER root"),
    ):
        assert dockerfile_problems(wrong, REPO)
