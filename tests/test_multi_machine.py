"""The "Workers on several machines" recipe of docs/studies.md, on one host.

A real ``mlflow server`` (its own SQLite store, artifacts proxied from a folder no worker sees),
one PostgreSQL database for Optuna, two ``modbench study run`` workers that share no file (each
its own empty working directory, HOME and TMPDIR), then ``modbench report`` from a third empty
directory, which can only analyse routing by fetching the checkpoints through the server.
"""

import http.client
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from modbench.track.optuna_store import trials_frame

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "studies" / "smoke.toml"
RECIPE_DOC = REPO / "docs" / "studies.md"  # the recipe, moved there from the README
POSTGRES = os.environ.get("MODBENCH_TEST_POSTGRES_URL")
SERVER_START_S = 180.0  # an overall deadline for the server to answer; the trigger is its answer
# The name workers on other machines use for the tracking host in the recipe.
TRACKING_HOST = "mlflow-host"


def modbench_command() -> list[str]:
    """The installed console script beside this interpreter (what the recipe runs), else the module."""
    script = Path(sys.executable).with_name("modbench")
    return [str(script)] if script.exists() else [sys.executable, "-m", "modbench.cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, path: str, host: str | None = None) -> tuple[int, str]:
    """GET ``path`` from the server on 127.0.0.1:``port`` with the given Host header."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Host": host or f"127.0.0.1:{port}"})
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        conn.close()


def isolated_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment minus anything that would point a process at a shared store or folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "MODBENCH_", "OPTUNA_"))}
    home.mkdir(parents=True, exist_ok=True)
    (home / "tmp").mkdir(exist_ok=True)
    env.update(HOME=str(home), TMPDIR=str(home / "tmp"), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", **extra)
    return env


def stop_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Terminate ``proc`` and every process of its session (it was started in a new one), and
    wait until none is left: the test leaves nothing running."""
    pgid = proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is None:
                try:
                    proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)  # children of the group still exiting
    proc.wait(timeout=timeout_s)


def recipe_server_command() -> tuple[dict[str, str], list[str]]:
    """The ``mlflow server`` command of the several-machines recipe (docs/studies.md): its environment
    assignments (``VAR=value mlflow server …``) and its argv."""
    text = RECIPE_DOC.read_text()
    section = text[text.index("**Workers on several machines.**"):]
    block = section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 7)]
    joined = block.replace("\\\n", " ")
    line = next(ln for ln in joined.splitlines() if "mlflow server" in ln and not ln.lstrip().startswith("#"))
    words = shlex.split(line)
    start = words.index("mlflow")
    env = dict(w.split("=", 1) for w in words[:start])
    return env, words[start:]


def as_run_here(argv: list[str], port: int, backend_store: str, artifacts: Path) -> list[str]:
    """The recipe's server command with only its placeholders filled in: this test's port, database
    and artifact folder (the host names, the host list and every other option as written)."""
    values = {"--port": str(port), "--backend-store-uri": backend_store, "--artifacts-destination": str(artifacts)}
    out = []
    for i, word in enumerate(argv):
        if i and argv[i - 1] in values:
            word = values[argv[i - 1]]
        elif i and argv[i - 1] in ("--allowed-hosts", "--cors-allowed-origins"):
            word = word.replace(":5000", f":{port}")
        out.append(word)
    return out


def option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def test_recipe_server_accepts_the_host_name_its_workers_use():
    """MLflow >= 3.5 answers 403 "Invalid Host header" to any name outside --allowed-hosts
    (default: localhost and private IPs), so the recipe's server must list the name and port
    its workers and report reach it by."""
    env, argv = recipe_server_command()
    text = RECIPE_DOC.read_text()
    section = text[text.index("**Workers on several machines.**"):]
    uris = set(re.findall(r"--tracking-uri (http://[^\s`]+)", section.split("## Reports")[0]))
    assert uris, "the recipe's workers name no tracking server"
    allowed = (option(argv, "--allowed-hosts") or "").split(",")
    origins = (option(argv, "--cors-allowed-origins") or "").split(",")
    for uri in uris:
        netloc = uri.removeprefix("http://").rstrip("/")
        assert netloc in allowed, f"--allowed-hosts {allowed} does not let {netloc} in: the workers would get 403"
        assert uri.rstrip("/") in origins, f"--cors-allowed-origins {origins}: the UI at {uri} could not POST"
    assert option(argv, "--artifacts-destination"), "artifacts must be proxied: workers see no shared folder"
    assert "--no-serve-artifacts" not in argv
    # An explicit list replaces MLflow's default (localhost and private IPs): an SSH-tunnelled UI
    # and a worker on the tracking host itself reach it as localhost or 127.0.0.1, on any port.
    from mlflow.server.security_utils import is_allowed_host_header

    for host in ("localhost:5000", "127.0.0.1:5000", "localhost:8080"):
        assert is_allowed_host_header(allowed, host), f"--allowed-hosts {allowed} refuses {host}"
    assert env.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION") == "false", "the GenAI job runner: 10 processes, ~3 GB"
    backend = option(argv, "--backend-store-uri")
    assert backend.startswith("postgresql") and "@" in backend and ":" not in backend.split("://")[1].split("@")[0], \
        "the recipe's database URL carries no password (PGPASSWORD or ~/.pgpass do)"


@pytest.fixture
def tracking_server(tmp_path):
    """A real MLflow tracking server, started by the recipe's command as written (PostgreSQL
    behind it, proxied artifacts, its host list, no GenAI job runner) with only the port, database
    and artifact folder filled in; yields (uri, port, artifact root, its database URL)."""
    if not POSTGRES:
        pytest.skip("set MODBENCH_TEST_POSTGRES_URL (CI starts PostgreSQL on 127.0.0.1)")
    artifacts = tmp_path / "server" / "artifacts"
    artifacts.mkdir(parents=True)
    log = tmp_path / "server" / "server.log"
    recipe_env, recipe_argv = recipe_server_command()
    mlflow = Path(sys.executable).with_name("mlflow")
    base = [str(mlflow)] if mlflow.exists() else [sys.executable, "-m", "mlflow"]
    proc = None
    with fresh_database() as database:
        if database is None:
            pytest.skip("the PostgreSQL user may not create databases (the server needs its own)")
        try:
            for _attempt in range(3):  # a port taken between free_port() and the bind: another port
                port = free_port()
                argv = base + as_run_here(recipe_argv, port, database, artifacts)[1:]
                with open(log, "w") as out:
                    env = isolated_env(tmp_path / "server" / "home", **recipe_env)
                    proc = subprocess.Popen(argv, cwd=tmp_path / "server", env=env,
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                deadline = time.monotonic() + SERVER_START_S
                while proc.poll() is None and time.monotonic() < deadline:
                    try:
                        status, _ = request(port, "/api/2.0/mlflow/experiments/search?max_results=1")
                        if status == 200:
                            break
                    except OSError:
                        pass
                    time.sleep(0.25)  # polling interval; the trigger is the server's answer
                else:
                    if proc.poll() is None:
                        pytest.fail(f"the MLflow server did not answer within {SERVER_START_S:g} s:\n{log.read_text()[-3000:]}")
                    if "already in use" in log.read_text() or "Address in use" in log.read_text():
                        stop_group(proc)
                        continue
                    pytest.fail(f"the MLflow server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
                break
            else:
                pytest.fail("no free port for the MLflow server after 3 tries")
            yield f"http://127.0.0.1:{port}", port, artifacts, database
        finally:
            if proc is not None:
                stop_group(proc)


@contextmanager
def fresh_database():
    """A new, empty database on the MODBENCH_TEST_POSTGRES_URL server, dropped afterwards; None
    without the right to create databases."""
    import sqlalchemy as sa

    url = sa.engine.make_url(POSTGRES)
    name = f"modbench_mm_{os.getpid()}_{time.monotonic_ns()}"
    admin = sa.create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.SQLAlchemyError:
        admin.dispose()
        yield None
        return
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            try:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            except sa.exc.ProgrammingError:  # before PostgreSQL 13; every client has exited
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


@pytest.fixture
def postgres_url():
    """A fresh database, as on a new cluster of machines whose workers start together (Optuna's
    schema is created by whichever gets there first); without the right to create databases, the
    given database itself (the study's unique name keeps it apart from every other)."""
    with fresh_database() as url:
        yield url or POSTGRES


@pytest.mark.postgres
@pytest.mark.skipif(not POSTGRES, reason="set MODBENCH_TEST_POSTGRES_URL (CI starts PostgreSQL on 127.0.0.1)")
def test_workers_opening_a_new_postgresql_database_at_the_same_instant_both_succeed():
    """The first workers on a new database both create Optuna's schema; unserialised, one fails
    with "duplicate key value violates unique constraint pg_type_typname_nsp_index"."""
    code = ("import sys; from modbench.track.optuna_store import connect_storage; print('ready', flush=True); "
            "sys.stdin.readline(); connect_storage(sys.argv[1]).engine.dispose(); print('opened', flush=True)")
    with fresh_database() as url:
        if url is None:
            pytest.skip("the PostgreSQL user may not create databases")
        procs = [subprocess.Popen([sys.executable, "-c", code, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        try:
            for p in procs:  # every process has imported everything and waits: release them together
                assert p.stdout.readline().strip() == "ready", p.communicate(timeout=60)[1][-2000:]
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            results = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failures = [err.strip().splitlines()[-1] for p, (_, err) in zip(procs, results) if p.returncode]
        assert not failures, failures
        assert [out.strip() for out, _ in results] == ["opened"] * 2


def tiny_study(tmp: Path, name: str) -> Path:
    """studies/smoke.toml (dense vs sigmoid on a 2-layer model) under a unique name, three seeds
    (six trials), trials of a few seconds: the two workers usually run side by side."""
    text = SMOKE.read_text().replace('name = "smoke"', f'name = "{name}"')
    text = text.replace('budget = "steps=6"', 'budget = "steps=40"').replace("seeds = [0, 1]", "seeds = [0, 1, 2]")
    assert f'name = "{name}"' in text and "steps=40" in text and "seeds = [0, 1, 2]" in text
    path = tmp / "study" / f"{name}.toml"
    path.parent.mkdir()
    path.write_text(text)
    return path


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.skipif(not POSTGRES, reason="set MODBENCH_TEST_POSTGRES_URL (CI starts PostgreSQL on 127.0.0.1)")
def test_two_workers_and_a_report_through_a_tracking_server_share_no_files(tmp_path, tracking_server, postgres_url):
    uri, port, artifact_root, _ = tracking_server
    # The server answers the name the recipe's workers use, and localhost and 127.0.0.1 (a tunnelled
    # UI, a worker on the tracking host), and refuses a name it was not given: the host check is on.
    for host in (f"{TRACKING_HOST}:{port}", f"localhost:{port}", f"127.0.0.1:{port}"):
        assert request(port, "/api/2.0/mlflow/experiments/search?max_results=1", host)[0] == 200, host
    status, body = request(port, "/api/2.0/mlflow/experiments/search?max_results=1", f"elsewhere.example:{port}")
    assert status == 403 and "Invalid Host header" in body

    name = f"multi_machine_{os.getpid()}_{int(time.time())}"  # unique even where the database is shared
    study = tiny_study(tmp_path, name)
    workers_dirs = [tmp_path / "worker_a", tmp_path / "worker_b"]
    # The recipe's worker command; --n-trials 3 (half the grid each) makes both workers take part
    # however unevenly a loaded machine schedules them, so "both ran trials" is never luck.
    # The storage comes from $MODBENCH_STORAGE, as in the recipe.
    args = ["study", "run", str(study), "--tracking-uri", uri, "--n-trials", "3", "--quiet"]
    workers = []
    try:
        for d in workers_dirs:
            d.mkdir()
            env = isolated_env(tmp_path / f"home_{d.name}", MODBENCH_STORAGE=postgres_url)
            workers.append(subprocess.Popen(modbench_command() + args, cwd=d, env=env,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                            start_new_session=True))
        outputs = [w.communicate(timeout=600)[0] for w in workers]
    finally:
        for w in workers:
            stop_group(w)
    assert [w.returncode for w in workers] == [0, 0], "\n".join(o[-3000:] for o in outputs)

    # Every (arm, seed) completed exactly once across the two workers, and both took part.
    df = trials_frame(name, postgres_url)
    expected = sorted((arm, seed) for arm in ("dense", "sigmoid C=0.25 alternate") for seed in (0, 1, 2))
    assert (df.state == "COMPLETE").all(), df[["number", "state", "arm", "seed", "fail_reason"]].to_string()
    assert sorted(zip(df.arm, df.seed)) == expected
    per_worker = df.worker.map(lambda w: int(str(w).rpartition(":")[2])).value_counts().to_dict()
    assert per_worker == {w.pid: 3 for w in workers}, per_worker

    # MLflow, through the server: one finished child run per trial, each with its checkpoint artifact,
    # stored by the server under its artifact root (the workers never saw that folder).
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert sorted((r.data.tags["modbench.arm"], int(r.data.tags["modbench.seed"])) for r in children) == expected
    assert all(r.info.status == "FINISHED" for r in children)
    assert {r.data.tags["modbench.checkpoint"] for r in children} == {"checkpoint/checkpoint.pt"}  # an artifact, no path
    assert {r.info.run_id for r in children} == set(df.mlflow_run_id)
    assert experiment.artifact_location.startswith("mlflow-artifacts:"), experiment.artifact_location  # proxied
    for run_id in df.mlflow_run_id:
        ckpt = artifact_root / experiment.experiment_id / run_id / "artifacts" / "checkpoint" / "checkpoint.pt"
        assert ckpt.is_file() and ckpt.stat().st_size > 0, f"no checkpoint of run {run_id} in the artifact root"

    # The workers shared no file: no MLflow store or artifacts of their own, and each holds the
    # trial folders of the trials it ran and none of the other's.
    for w, d in zip(workers, workers_dirs):
        files = files_under(d)
        assert not {f for f in files if Path(f).name in ("mlflow.db", "mlruns", "mlartifacts")}, sorted(files)
        own = {f"trial-{n}" for n, wk in zip(df.number, df.worker) if wk.endswith(f":{w.pid}")}
        trial_dirs = {Path(f).name for f in files if Path(f).parent.as_posix() == f"runs/studies/{name}/trials"}
        assert own and trial_dirs == own, (sorted(trial_dirs), sorted(own))

    # The report, from a third empty directory, with the workers' folders gone (as on another
    # machine): the full report, routing analysis included, which needs every routed arm's
    # checkpoint fetched through the tracking server.
    for d in workers_dirs:
        d.rename(d.with_name(d.name + "_gone"))
    reporter = tmp_path / "reporter"
    reporter.mkdir()
    done = subprocess.run(modbench_command() + ["report", str(study), "--tracking-uri", uri, "--storage", postgres_url, "--quiet"],
                          cwd=reporter, env=isolated_env(tmp_path / "home_reporter"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report_dir = reporter / "reports" / name
    report = (report_dir / "report.md").read_text()
    assert "Trials: 6 complete of 6 planned" in report
    arms_table = report.split("## Arms (validation top-k)")[1].split("\n## ")[0]
    assert re.search(r"^\| dense ", arms_table, re.M) and re.search(r"^\| sigmoid C=0.25 alternate ", arms_table, re.M), arms_table
    routing = report.split("## Routing\n")[1].split("\n## ")[0]
    assert "No trial checkpoints were found" not in routing
    assert "![routing by position](routing_positions.png)" in routing and "sigmoid C=0.25 alternate" in routing
    assert (report_dir / "routing_positions.png").stat().st_size > 0
    assert (report_dir / "routing_heatmap.png").stat().st_size > 0
    assert not (reporter / "mlflow.db").exists() and not (reporter / "mlartifacts").exists()
    # The report is logged on the study's parent run, through the server, into its artifact root.
    parent = next(r for r in runs if r.data.tags.get("modbench.role") == "study")
    assert (artifact_root / experiment.experiment_id / parent.info.run_id / "artifacts" / "report" / "report.md").is_file()
