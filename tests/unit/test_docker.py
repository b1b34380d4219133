"""Static checks of docker/: the compose deployment (Airflow + two Slurm clusters).

There is no Docker engine on the development or CI machines, so nothing here builds an image or
starts a container. What can be checked without one is checked for real: the YAML, the service
graph, the build contexts and what the Dockerfiles copy, the bind mounts, the shell scripts
(``bash -n``, shellcheck), the Airflow CLI commands (Airflow's own parser), the Slurm config the
cluster containers render from their environment (the real ``slurm-cluster render``), the
connections the init job writes, and ``docker compose config`` where a Compose is installed.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE_FILE = DOCKER / "docker-compose.yml"
ENTRYPOINT = DOCKER / "slurm" / "entrypoint.sh"
INIT_SCRIPT = DOCKER / "airflow" / "init.sh"

TRIGGERERS = ("triggerer-1", "triggerer-2")
WORKERS = ("worker-1", "worker-2")
#: the services started once the Celery broker is healthy (the scheduler queues on it, the
#: workers consume; the triggerers just start with them)
CELERY_CLIENTS = ("scheduler", *WORKERS, *TRIGGERERS)
AIRFLOW_SERVICES = ("api-server", "scheduler", "dag-processor", *TRIGGERERS, *WORKERS)
REQUIRED_SERVICES = (*AIRFLOW_SERVICES, "init", "postgres", "redis", "slurm-alpha", "slurm-beta")
ONE_SHOT = ("init", "ssh-keys")
SCRATCH = "/tmp/airflow-skypilot-demo"

#: what the deployment promises (docker/README.md): cluster -> nodes, GPUs, partitions
EXPECTED_CLUSTERS = {
    "slurm-alpha": {
        "cluster": "alpha",
        "nodes": {"a1": "gpu:a100:4", "a2": "gpu:a100:4"},
        "partitions": {"batch": (["a1", "a2"], True), "short": (["a2"], False)},
    },
    "slurm-beta": {
        "cluster": "beta",
        "nodes": {"b1": "gpu:h100:8"},
        "partitions": {"main": (["b1"], True)},
    },
}


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict[str, Any]]:
    return compose["services"]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def interpolate_defaults(text: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR}`` with an empty environment."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "",
                  text)


def volume_mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """container path -> (source, read_only) for the short volume syntax."""
    out = {}
    for item in service.get("volumes") or []:
        assert isinstance(item, str), f"long volume syntax not expected here: {item!r}"
        parts = item.split(":")
        source, target = parts[0], parts[1]
        out[target] = (source, len(parts) > 2 and "ro" in parts[2].split(","))
    return out


def mount_of(service: dict[str, Any], volume: str) -> str | None:
    for target, (source, _) in volume_mounts(service).items():
        if source == volume:
            return target
    return None


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def slurm_connections():
    return load_module(DOCKER / "airflow" / "slurm_connections.py", "docker_slurm_connections")


@pytest.fixture(scope="module")
def login_nodes(services, slurm_connections):
    return slurm_connections.parse_login_nodes(
        env_of(services["init"])["SKYPILOT_SLURM_CONNECTIONS"])


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern also matches a path's parents."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        regex = fnmatch.translate(pat).replace(".*", "[^/]*")
        if pat.startswith("**/"):
            regex = "(.*/)?" + fnmatch.translate(pat[3:]).replace(".*", "[^/]*")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def builds(services) -> dict[str, tuple[Path, Path]]:
    """service -> (context dir, Dockerfile) for every service with ``build:``."""
    out = {}
    for name, service in services.items():
        build = service.get("build")
        if build is None:
            continue
        if isinstance(build, str):
            build = {"context": build}
        context = (DOCKER / build.get("context", ".")).resolve()
        out[name] = (context, context / build.get("dockerfile", "Dockerfile"))
    return out


# --------------------------------------------------------------------------- the compose file


def test_compose_file_parses_and_declares_the_services(services):
    missing = [s for s in REQUIRED_SERVICES if s not in services]
    assert not missing, f"services missing from docker-compose.yml: {missing}"


def test_long_running_services_have_healthchecks(services):
    for name, service in services.items():
        if name in ONE_SHOT:
            assert str(service.get("restart", "no")) == "no", f"{name} is a one-shot job"
            continue
        check = service.get("healthcheck") or {}
        assert check.get("test"), f"{name} has no healthcheck"
        assert not check.get("disable"), name


def test_depends_on_conditions(services):
    for name in AIRFLOW_SERVICES:
        deps = depends_on(services[name])
        assert deps.get("postgres") == "service_healthy", name
        assert deps.get("init") == "service_completed_successfully", name
    for name in ("scheduler", "dag-processor", *TRIGGERERS, *WORKERS):
        assert depends_on(services[name]).get("api-server") == "service_healthy", name
    for name in CELERY_CLIENTS:
        assert depends_on(services[name]).get("redis") == "service_healthy", name
    init = depends_on(services["init"])
    for name in ("postgres", "slurm-alpha", "slurm-beta"):
        assert init.get(name) == "service_healthy", f"init must wait for {name}"
    for name in ("slurm-alpha", "slurm-beta"):
        assert depends_on(services[name]).get("ssh-keys") == "service_completed_successfully"


def test_dependency_graph_is_sound_and_acyclic(services):
    valid = {"service_started", "service_healthy", "service_completed_successfully"}
    for name, service in services.items():
        for dep, condition in depends_on(service).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert condition in valid, f"{name} -> {dep}: {condition}"
            if condition == "service_healthy":
                assert services[dep].get("healthcheck"), f"{dep} has no healthcheck for {name}"
            if condition == "service_completed_successfully":
                assert str(services[dep].get("restart", "no")) == "no", f"{dep} restarts"
    remaining = {name: set(depends_on(s)) for name, s in services.items()}
    while remaining:
        ready = [n for n, deps in remaining.items() if not deps & remaining.keys()]
        assert ready, f"depends_on cycle among {sorted(remaining)}"
        for n in ready:
            del remaining[n]


def test_named_volumes_are_declared(compose, services):
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for target, (source, _) in volume_mounts(service).items():
            if not source.startswith((".", "/", "~", "$")):
                assert source in declared, f"{name}: volume {source} ({target}) not declared"


def test_bind_mounted_paths_exist(services):
    for name, service in services.items():
        for target, (source, _) in volume_mounts(service).items():
            source = interpolate_defaults(source)
            if source.startswith((".", "/")):
                path = (DOCKER / source).resolve()
                assert path.exists(), f"{name}: bind mount {source} -> {target}: {path} missing"
                assert REPO in (path, *path.parents), f"{name}: {source} is outside the repo"


def test_dags_are_mounted_where_airflow_looks(services):
    for name in AIRFLOW_SERVICES:
        mounts = volume_mounts(services[name])
        assert mounts.get("/opt/airflow/dags") == ("../dags", True), name


def test_airflow_settings(services):
    expected = {
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CELERY__BROKER_URL": "redis://redis:6379/0",
        "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "true",
        "AIRFLOW__SKYPILOT__CONNECTIONS": "slurm_alpha,slurm_beta",
    }
    for name in (*AIRFLOW_SERVICES, "init"):
        env = env_of(services[name])
        for key, value in expected.items():
            assert env.get(key) == value, f"{name}: {key}={env.get(key)!r}"
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].split("@")[1].startswith("postgres/")
        backend = env["AIRFLOW__CELERY__RESULT_BACKEND"]
        assert backend.startswith("db+postgresql://"), backend
        assert backend.split("@")[1] == "postgres/airflow", backend
        url = env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"]
        assert url == "http://api-server:8080/execution/", url
        image = services[name].get("image")
        assert image == services["api-server"]["image"], f"{name} runs another image"
    assert "8080" in services["api-server"]["ports"][0].split(":")[-1]
    assert services["api-server"]["command"] == "api-server"
    for name in ("scheduler", "dag-processor"):
        assert services[name]["command"] == name
    for name in TRIGGERERS:
        assert services[name]["command"] == "triggerer", name
    for name in WORKERS:
        assert services[name]["command"] == "celery worker", name
    # distinct host names: the task instances' and the jobs' `hostname` tell them apart
    hosts = [services[name].get("hostname") for name in (*TRIGGERERS, *WORKERS)]
    assert hosts == [*TRIGGERERS, *WORKERS], hosts


def test_redis_is_the_official_image_unless_overridden(services):
    redis = services["redis"]
    assert re.fullmatch(r"\$\{REDIS_IMAGE:-redis:7[^}]*\}", redis["image"]), redis["image"]
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    # the offline stand-ins: build.sh builds one for every image the compose file pulls, and
    # e2e.sh points the compose file at it
    build_sh = (DOCKER / "offline" / "build.sh").read_text()
    e2e = (DOCKER / "offline" / "e2e.sh").read_text()
    for var, tag in (("POSTGRES_IMAGE", "airflow-skypilot/postgres:offline"),
                     ("REDIS_IMAGE", "airflow-skypilot/redis:offline")):
        assert f"build {tag}" in build_sh, tag
        assert f'export {var}="${{{var}:-{tag}}}"' in e2e, var
    steps = dockerfile_instructions(DOCKER / "offline" / "redis.Dockerfile")
    assert any(w == "RUN" and "redis-server" in a for w, a in steps)
    cmd = json.loads(next(a for w, a in steps if w == "CMD"))
    assert cmd[0] == "redis-server" and "--protected-mode" in cmd, cmd


def test_worker_healthcheck_pings_the_celery_app(services):
    """The workers' healthcheck names Airflow's Celery app by module: it must exist."""
    for name in WORKERS:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL", test
        words = shlex.split(test[1].replace("$$", "$"))
        assert words[:2] == ["celery", "--app"] and words[3:6] == ["inspect", "ping", "-d"], words
        assert words[6] == "celery@${HOSTNAME}", words
        module, _, attr = words[2].rpartition(".")
        # (a lazy module attribute, PEP 562: what `celery --app` gets too)
        assert getattr(importlib.import_module(module), attr, None) is not None, words[2]


def test_secrets_come_from_files_the_init_job_writes(services):
    init_script = INIT_SCRIPT.read_text()
    init_env = env_of(services["init"])
    assert not [k for k in init_env if k.endswith("_CMD")], \
        "init must not read secrets before it has generated them"
    for name in AIRFLOW_SERVICES:
        env = env_of(services[name])
        for key in ("AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET",
                    "AIRFLOW__API__SECRET_KEY"):
            assert key not in env, f"{name}: {key} hard-coded"
            command = env.get(f"{key}_CMD", "")
            match = re.fullmatch(r"cat /opt/airflow/auth/(\w+)", command)
            assert match, f"{name}: {key}_CMD={command!r}"
            assert f"new_secret {match.group(1)} " in init_script, match.group(1)
            assert f'{key}_CMD="cat ${{auth_dir}}/{match.group(1)}"' in init_script
        assert mount_of(services[name], "airflow-auth") == "/opt/airflow/auth", name
    assert mount_of(services["init"], "airflow-auth") == "/opt/airflow/auth"


def compose_plugin() -> bool:
    if not shutil.which("docker"):
        return False
    proc = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60)
    return proc.returncode == 0


def _missing(what: str) -> None:
    """`make test` installs the checker (Makefile DEBS): its absence is a failure, never a
    skip that would count as checked."""
    pytest.fail(f"{what}: `make system-deps` installs it")


def test_compose_config_validates():
    """`docker compose config` (v2) where the plugin exists, else Compose v1 if installed."""
    if compose_plugin():
        proc = subprocess.run(["docker", "compose", "-f", str(COMPOSE_FILE), "config", "-q"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return
    if not shutil.which("docker-compose"):
        _missing("neither the `docker compose` plugin nor docker-compose v1 is installed")
    # Compose v1 predates the top-level `name:` of the Compose Specification; validate the rest.
    text = "\n".join(line for line in COMPOSE_FILE.read_text().splitlines()
                     if not line.startswith("name:"))
    proc = subprocess.run(["docker-compose", "-f", "-", "--project-directory", str(DOCKER),
                           "config", "-q"], input=text, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- images


def test_every_build_points_at_an_existing_dockerfile(services):
    found = builds(services)
    assert {"init", "slurm-alpha", "slurm-beta", *AIRFLOW_SERVICES} <= found.keys()
    for name, (context, dockerfile) in found.items():
        assert context.is_dir(), f"{name}: build context {context} missing"
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        assert REPO in (context, *context.parents), f"{name}: context outside the repo"
        assert services[name].get("image"), f"{name}: a built image should be named"


def test_every_copied_file_exists_and_is_sent_to_the_builder(services):
    for _name, (context, dockerfile) in builds(services).items():
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
        patterns = [ln.strip() for ln in ignore.read_text().splitlines()
                    if ln.strip() and not ln.startswith("#")] if ignore.exists() else []
        copies = [args for word, args in dockerfile_instructions(dockerfile)
                  if word in ("COPY", "ADD")]
        assert copies, dockerfile
        for args in copies:
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            for source in words[:-1]:
                path = context / source
                assert path.exists(), f"{dockerfile.name}: COPY {source}: {path} missing"
                files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()
                                                       and "__pycache__" not in p.parts]
                for file in files:
                    rel = file.relative_to(context).as_posix()
                    assert not dockerignore_excludes(patterns, rel), \
                        f"{dockerfile.name}: {rel} is copied but excluded by {ignore.name}"


def test_build_contexts_leave_out_local_state():
    patterns = [ln.strip() for ln in
                (DOCKER / "airflow.Dockerfile.dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for path in (".venv/bin/python", ".sandbox/slurm/ssh/id_ed25519", ".git/config",
                 "airflow_skypilot/__pycache__/x.pyc", "tests/unit/test_docker.py"):
        assert dockerignore_excludes(patterns, path), path
    for path in ("pyproject.toml", "README.md", "airflow_skypilot/cli.py",
                 "docker/airflow/init.sh"):
        assert not dockerignore_excludes(patterns, path), path


def test_airflow_image_installs_the_repository_from_its_pyproject():
    dockerfile = DOCKER / "airflow.Dockerfile"
    steps = dockerfile_instructions(dockerfile)
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for w, a in steps if w == "ARG" and "=" in a}
    base = next(a for w, a in steps if w == "FROM")
    # the official image by default (docker/offline/build.sh passes its stand-in)
    assert base == "${AIRFLOW_BASE_IMAGE}"
    assert args["AIRFLOW_BASE_IMAGE"].replace("${AIRFLOW_VERSION}", args["AIRFLOW_VERSION"]) \
        == "apache/airflow:3.3.2"
    copies = [a for w, a in steps if w == "COPY"]
    pyproject_dest = next(shlex.split(c)[-1] for c in copies if "pyproject.toml" in c)
    pip = [a for w, a in steps if w == "RUN" and "pip install" in a]
    assert len(pip) == 1, pip
    install = pip[0]
    assert pyproject_dest.rstrip("/") in install, "pip must install the copied project"
    # pinned to the image's own version, with the Celery provider the compose file's executor needs
    assert '"apache-airflow[celery]==${AIRFLOW_VERSION}"' in install, install
    assert '--constraint "${HOME}/constraints.txt"' in install
    # Not a hand-kept copy of the dependency list: pyproject.toml is the only source.
    text = dockerfile.read_text()
    deps = re.findall(r'"([A-Za-z0-9_.\-]+)', (REPO / "pyproject.toml").read_text()
                      .split("dependencies = [", 1)[1].split("]", 1)[0])
    for dep in deps:
        if dep != "apache-airflow":
            assert dep not in text, f"{dep} is listed in the Dockerfile; pyproject.toml has it"


def test_slurm_image_has_what_the_backend_runs():
    steps = dockerfile_instructions(DOCKER / "slurm.Dockerfile")
    assert next(a for w, a in steps if w == "FROM") == "debian:bookworm-slim"
    install = " ".join(a for w, a in steps if w == "RUN" and "apt-get install" in a)
    for package in ("slurmctld", "slurmd", "slurm-client", "munge", "openssh-server",
                    "openssh-sftp-server", "procps"):
        assert re.search(rf"(^|\s){re.escape(package)}(\s|$)", install), package
    assert ("ENTRYPOINT", '["/usr/local/bin/slurm-cluster"]') in steps
    sshd = (DOCKER / "slurm" / "sshd_config").read_text()
    assert re.search(r"^PasswordAuthentication no$", sshd, re.M)
    assert re.search(r"^PermitRootLogin no$", sshd, re.M)
    assert re.search(r"^Subsystem sftp /usr/lib/openssh/sftp-server$", sshd, re.M)
    assert "HostKey /var/lib/login-node/ssh_host_ed25519_key" in sshd


def test_login_user_matches_between_image_and_connections(services):
    steps = dockerfile_instructions(DOCKER / "slurm.Dockerfile")
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for w, a in steps if w == "ARG" and "=" in a}
    assert env_of(services["init"])["SKYPILOT_SLURM_LOGIN_USER"] == args["LOGIN_USER"]


# --------------------------------------------------------------------------- shell scripts


def shell_scripts() -> list[Path]:
    scripts = sorted(DOCKER.rglob("*.sh"))
    assert ENTRYPOINT in scripts and INIT_SCRIPT in scripts
    return scripts


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: p.relative_to(DOCKER).as_posix())
def test_shell_script_syntax(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n"), script
    assert "set -euo pipefail" in text, script
    assert os.access(script, os.X_OK), f"{script} is not executable"


def test_shellcheck():
    if not shutil.which("shellcheck"):
        _missing("shellcheck is not installed")
    proc = subprocess.run(["shellcheck", *map(str, shell_scripts())], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_airflow_cli_commands_parse(services, tmp_path):
    """Every `airflow ...` the compose file, init.sh and the README run, parsed by Airflow."""
    commands: list[list[str]] = []
    for name in AIRFLOW_SERVICES:
        commands.append(shlex.split(services[name]["command"]))
    for service in services.values():
        test = (service.get("healthcheck") or {}).get("test") or []
        if len(test) > 1 and test[1] == "airflow":
            commands.append(test[2:])
    for line in INIT_SCRIPT.read_text().splitlines():
        line = line.strip()
        if line.startswith("airflow "):
            words = shlex.split(line.split("||")[0].split(">")[0])
            commands.append([w if not w.startswith("$") else "x" for w in words[1:]])
    readme = (DOCKER / "README.md").read_text()
    for match in re.finditer(r"exec scheduler airflow (.+)", readme):
        commands.append(shlex.split(match.group(1)))
    assert len(commands) >= 10, commands
    script = ("import json, sys\nfrom airflow.cli.cli_parser import get_parser\n"
              "parser = get_parser()\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    parser.parse_args(argv)\n")
    # the compose file's executor: `airflow celery ...` exists only with the CeleryExecutor
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__EXECUTOR": env_of(services["scheduler"])["AIRFLOW__CORE__EXECUTOR"]}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(commands)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{commands}\n{proc.stderr[-3000:]}"


def test_api_server_healthcheck_endpoint_exists(services):
    from airflow.api_fastapi.core_api.routes.public import monitor

    test = services["api-server"]["healthcheck"]["test"]
    url = next(w for w in test if w.startswith("http://"))
    path = url.split("8080", 1)[1]
    routes = {route.path for route in monitor.monitor_router.routes}
    assert path.startswith("/api/v2/") and path[len("/api/v2"):] in routes, (path, routes)


# --------------------------------------------------------------------------- Slurm clusters


def render(env: dict[str, str], out: Path) -> subprocess.CompletedProcess[str]:
    run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env,
               "SLURM_TEMPLATE_DIR": str(DOCKER / "slurm"), "SLURM_CONTROL_HOST": "testhost"}
    return subprocess.run(["bash", str(ENTRYPOINT), "render", str(out)], env=run_env,
                          capture_output=True, text=True, timeout=60)


def parse_conf(text: str) -> list[dict[str, str]]:
    lines = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            lines.append(dict(word.split("=", 1) for word in line.split() if "=" in word))
    return lines


@pytest.mark.parametrize("service_name", sorted(EXPECTED_CLUSTERS))
def test_rendered_slurm_config_declares_the_compose_clusters(services, service_name, tmp_path):
    expected = EXPECTED_CLUSTERS[service_name]
    env = env_of(services[service_name])
    proc = render(env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    conf = (tmp_path / "slurm.conf").read_text()
    assert "@" not in conf, "a placeholder was left unfilled"
    entries = parse_conf(conf)
    settings = {k: v for e in entries if len(e) == 1 for k, v in e.items()}
    assert settings["ClusterName"] == expected["cluster"] == env["SLURM_CLUSTER_NAME"]
    assert settings["GresTypes"] == "gpu"
    assert settings["ProctrackType"] == "proctrack/linuxproc"
    assert settings["SlurmdParameters"] == "config_overrides"
    assert settings["SlurmctldHost"] == "testhost(127.0.0.1)"
    nodes = {e["NodeName"]: e for e in entries if "NodeName" in e}
    assert {n: e["Gres"] for n, e in nodes.items()} == expected["nodes"]
    assert len({e["Port"] for e in nodes.values()}) == len(nodes), "each slurmd needs a port"
    assert len({e["NodeAddr"] for e in nodes.values()}) == len(nodes)
    parts = {e["PartitionName"]: e for e in entries if "PartitionName" in e}
    assert {p: (e["Nodes"].split(","), e["Default"] == "YES") for p, e in parts.items()} \
        == expected["partitions"]
    if service_name == "slurm-alpha":
        assert parts["short"]["MaxTime"] == "10"
    gres_text = (tmp_path / "gres.conf").read_text()
    assert gres_text.splitlines()[0] == "AutoDetect=off"
    gres = parse_conf(gres_text)
    gres_nodes = {e["NodeName"]: e for e in gres if "NodeName" in e}
    assert gres_nodes.keys() == nodes.keys()
    for node, entry in gres_nodes.items():
        count = int(nodes[node]["Gres"].rsplit(":", 1)[1])
        assert entry["Type"] == nodes[node]["Gres"].split(":")[1]
        assert entry["File"].endswith(f"/{node}/nvidia[0-{count - 1}]"), entry


@pytest.mark.parametrize("change, message", [
    ({"SLURM_PARTITIONS": "batch=a1,a9"}, "not in SLURM_NODES"),
    ({"SLURM_DEFAULT_PARTITION": "gpu"}, "is not a partition"),
    ({"SLURM_GPU_TYPE": ""}, "SLURM_GPU_TYPE must be set"),
    ({"SLURM_GPUS_PER_NODE": "four"}, "whole number"),
    ({"SLURM_PARTITION_MAXTIME": "nope=10"}, "SLURM_PARTITION_MAXTIME"),
])
def test_render_refuses_a_bad_cluster_description(services, tmp_path, change, message):
    proc = render({**env_of(services["slurm-alpha"]), **change}, tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_clusters_share_scratch_at_the_dags_workspace(services):
    dag = (REPO / "dags" / "train_pipeline.py").read_text()
    assert f'"workspace": "{SCRATCH}"' in dag, "the DAG's default workspace moved"
    for name in ("slurm-alpha", "slurm-beta", *WORKERS, "init"):
        assert mount_of(services[name], "scratch") == SCRATCH, name
    for name in ("slurm-alpha", "slurm-beta"):
        assert env_of(services[name])["SCRATCH_DIR"] == SCRATCH
    assert env_of(services["init"])["SKYPILOT_SCRATCH_DIR"] == SCRATCH


def test_clusters_are_distinct(services):
    names = [env_of(services[s])["SLURM_CLUSTER_NAME"] for s in EXPECTED_CLUSTERS]
    assert len(set(names)) == len(names)
    login = [mount_of(services[s], f"{s}-login") for s in EXPECTED_CLUSTERS]
    assert login == ["/var/lib/login-node"] * len(login), "each login node keeps its host key"
    for name in EXPECTED_CLUSTERS:
        assert services[name].get("hostname") == name
        assert services[name].get("init") is True, "a reaper for orphaned job processes"


# --------------------------------------------------------------------------- keys and connections


def test_connections_named_in_skypilot_config_are_created_by_init(services, login_nodes):
    created = {n.conn_id for n in login_nodes}
    for name in (*AIRFLOW_SERVICES, "init"):
        wanted = env_of(services[name])["AIRFLOW__SKYPILOT__CONNECTIONS"].split(",")
        assert set(wanted) <= created, f"{name}: {wanted} vs init's {created}"


def test_each_connection_reaches_a_cluster_service(services, login_nodes):
    for node in login_nodes:
        assert node.host in services, f"{node.conn_id}: no service {node.host}"
        env = env_of(services[node.host])
        assert env["SLURM_CLUSTER_NAME"] == node.cluster, node
        assert node.port == 22
        assert "slurm-cluster" in services[node.host]["healthcheck"]["test"]
        assert depends_on(services["init"]).get(node.host) == "service_healthy"


def test_keys_are_shared_through_the_right_volumes(services):
    init_env = env_of(services["init"])
    key_dir = mount_of(services["init"], "ssh-client")
    assert init_env["SKYPILOT_SSH_KEY_FILE"] == f"{key_dir}/id_ed25519"
    # the API server runs no task, but its Capacity page probes [skypilot] connections over SSH
    # in that process (airflow_skypilot/plugins/capacity.py): without the key every row is an
    # SSH error
    for name in (*WORKERS, *TRIGGERERS, "api-server", "init"):
        mounts = volume_mounts(services[name])
        assert mounts.get(key_dir) == ("ssh-client", True), f"{name} needs the key, read-only"
    assert env_of(services["api-server"])["AIRFLOW__SKYPILOT__CONNECTIONS"]
    for name in ("scheduler", "dag-processor"):
        assert mount_of(services[name], "ssh-client") is None, f"{name} never reaches a cluster"
    assert init_env["SKYPILOT_SSH_PUBLIC_DIR"] == mount_of(services["init"], "ssh-public")
    keygen_env = env_of(services["ssh-keys"])
    assert keygen_env["SSH_CLIENT_DIR"] == mount_of(services["ssh-keys"], "ssh-client")
    assert keygen_env["SSH_PUBLIC_DIR"] == mount_of(services["ssh-keys"], "ssh-public")
    for name in EXPECTED_CLUSTERS:
        env = env_of(services[name])
        assert env["SSH_PUBLIC_DIR"] == mount_of(services[name], "ssh-public")
        assert mount_of(services[name], "ssh-client") is None, "clusters never see the private key"
    uid = interpolate_defaults(services["scheduler"]["user"]).split(":")[0]
    assert interpolate_defaults(keygen_env["AIRFLOW_UID"]) == uid == "50000"
    assert interpolate_defaults(env_of(services["init"])["AIRFLOW_UID"]) == uid


def test_workers_share_one_placement_ledger(compose, services):
    """A sweep split across the workers avoids the GPUs either placed only if both lock and
    write the same ledger file (airflow_skypilot/ledger.py): a named volume both mount, at the
    directory of the file `[skypilot] placement_ledger` names, writable by the Airflow user."""
    paths = {name: env_of(services[name]).get("AIRFLOW__SKYPILOT__PLACEMENT_LEDGER")
             for name in WORKERS}
    assert len(set(paths.values())) == 1, paths
    path = paths[WORKERS[0]]
    assert path and path.startswith("/"), f"the ledger must be a file on the shared volume: {path}"
    ledger_dir = os.path.dirname(path)
    sources = set()
    for name in WORKERS:
        source, read_only = volume_mounts(services[name]).get(ledger_dir, (None, True))
        assert source is not None, f"{name}: nothing mounted at {ledger_dir}"
        assert not read_only, f"{name} must write the ledger"
        sources.add(source)
    (source,) = sources
    assert source in (compose.get("volumes") or {}), f"{source}: not a named volume"
    # no one else writes a stale copy there; init prepares it for AIRFLOW_UID
    for name in ("api-server", "scheduler", "dag-processor", *TRIGGERERS):
        assert mount_of(services[name], source) is None, name
    assert mount_of(services["init"], source) == ledger_dir
    assert env_of(services["init"])["AIRFLOW__SKYPILOT__PLACEMENT_LEDGER"] == path
    init_script = INIT_SCRIPT.read_text()
    assert 'ledger="${AIRFLOW__SKYPILOT__PLACEMENT_LEDGER:-}"' in init_script
    assert 'install -d -m 0770 -o "$airflow_uid" -g 0 "$ledger_dir"' in init_script
    # the option exists under that name (env AIRFLOW__SKYPILOT__PLACEMENT_LEDGER)
    from airflow_skypilot.get_provider_info import get_provider_info

    assert "placement_ledger" in get_provider_info()["config"]["skypilot"]["options"]


def test_init_prepares_the_ledger_volume_for_the_airflow_user(services, tmp_path):
    """init.sh's volume step, run for real on a temp dir: the ledger's directory ends up
    AIRFLOW_UID's, mode 0770 (as root; otherwise what it can check)."""
    text = INIT_SCRIPT.read_text()
    start = text.index('if [ -n "$ledger" ]; then')
    block = text[start:text.index("\nfi\n", start) + 4]
    ledger = tmp_path / "skypilot" / "placements.json"
    uid = os.getuid()
    script = f'set -euo pipefail\nairflow_uid={uid}\nledger={shlex.quote(str(ledger))}\n{block}'
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    st = ledger.parent.stat()
    assert st.st_uid == uid and (st.st_mode & 0o777) == 0o770, oct(st.st_mode)


def test_written_connections_pin_host_keys(login_nodes, slurm_connections, tmp_path):
    hostkeys = tmp_path / "hostkeys"
    hostkeys.mkdir()
    for i, node in enumerate(login_nodes):
        key = f"AAAAC3NzaC1lZDI1NTE5AAAAI{i:0>43}"
        (hostkeys / f"{node.cluster}.pub").write_text(f"ssh-ed25519 {key} login@{node.cluster}\n")
    conns = slurm_connections.build_connections(login_nodes, tmp_path, "/opt/airflow/ssh/k",
                                                "skyuser")
    assert set(conns) == {n.conn_id for n in login_nodes}
    for node in login_nodes:
        conn = conns[node.conn_id]
        assert conn["conn_type"] == "slurm"
        assert (conn["host"], conn["port"], conn["login"]) == (node.host, 22, "skyuser")
        extra = conn["extra"]
        assert extra["host_key"].startswith("ssh-ed25519 AAAA")
        assert len(extra["host_key"].split()) == 2, "type and key only, no comment"
        assert extra["cluster"] == node.cluster
        assert extra["key_file"] == "/opt/airflow/ssh/k"
        assert "no_host_key_check" not in extra
    # `airflow connections import` reads exactly this form
    from airflow.models.connection import Connection

    for conn_id, conn in conns.items():
        made = Connection(conn_id=conn_id, **conn)
        assert made.extra_dejson["host_key"] == conn["extra"]["host_key"]


def test_missing_or_bad_host_key_is_an_error(login_nodes, slurm_connections, tmp_path):
    with pytest.raises(slurm_connections.SetupError, match="no host key"):
        slurm_connections.build_connections(login_nodes, tmp_path, "/k", "skyuser")
    (tmp_path / "hostkeys").mkdir()
    for node in login_nodes:
        (tmp_path / "hostkeys" / f"{node.cluster}.pub").write_text("not a key\n")
    with pytest.raises(slurm_connections.SetupError, match="OpenSSH public key"):
        slurm_connections.build_connections(login_nodes, tmp_path, "/k", "skyuser")


@pytest.mark.parametrize("text, message", [
    ("slurm_a slurm-a", "expected"),
    ("slurm_a slurm-a:x a", "bad port"),
    ("slurm_a h:22 a\nslurm_a h2:22 b", "repeats"),
    ("# nothing\n", "names no login node"),
])
def test_login_node_list_errors(slurm_connections, text, message):
    with pytest.raises(slurm_connections.SetupError, match=message):
        slurm_connections.parse_login_nodes(text)


def test_capacity_check(slurm_connections):
    ok = [{"connection": "a", "location": "batch", "accelerator": "A100", "free": 8, "total": 8},
          {"connection": "b", "location": "main", "accelerator": "H100", "free": 8, "total": 8}]
    assert slurm_connections.check_capacity(ok, ["a", "b"]) == []
    bad = [ok[0], {"connection": "b", "location": "", "error": "BackendUnreachable: refused"}]
    assert slurm_connections.check_capacity(bad, ["a", "b"]) == ["b: BackendUnreachable: refused"]
    assert slurm_connections.check_capacity(ok[:1], ["a", "b"]) == ["b: no capacity rows"]


def test_no_host_key_check_is_never_disabled():
    for path in DOCKER.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace").lower()
            assert not re.search(r"no_host_key_check\W+true", text), path
            assert not re.search(r"allow_host_key_change\W+true", text), path
            assert "stricthostkeychecking=no" not in text.replace(" ", ""), path


def test_readme_covers_the_essentials():
    readme = (DOCKER / "README.md").read_text()
    for text in ("docker compose -f docker/docker-compose.yml", "up --build",
                 "http://localhost:8080", "admin", "kill-node", "start-node",
                 "Differences from the test sandbox", "CI has no Docker engine"):
        assert text in readme, text
