"""Issue 7, acceptance 3: TLS and auth against a real etcd, and two jobs on one etcd.

The secure etcd requires client certificates (``--client-cert-auth``) and has auth enabled; the
job user's role may read and write only the key prefix of this module's jobs. Real
``elastic-run`` agents get their CA, certificate, key, user and password from the
``ELASTIC_ETCD_*`` variables, as in the Kubernetes manifests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from membership.etcd import EtcdConfig
from tests.integration.launcher_scripts.harness import (
    REPO,
    WORKER,
    Agent,
    alive,
    cluster,
    etcd_or_skip,
    tree,
)
from tests.integration.launcher_scripts.secure_etcd import SecureEtcd, secure_etcd
from tests.integration.launcher_scripts.status_cli import run_status
from tests.integration.training.example_job import ExampleJob

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

_ENV_KEYS = ("ELASTIC_ETCD_CA_CERT", "ELASTIC_ETCD_CERT", "ELASTIC_ETCD_KEY",
             "ELASTIC_ETCD_USERNAME", "ELASTIC_ETCD_PASSWORD", "ELASTIC_ETCD_ENDPOINTS")
# A wrong password as distinctive as the right one, so a leak of either is found in the logs.
_WRONG_PASSWORD = "wrong-Hq4mYt8Vb2"


@pytest.fixture(scope="module")
def job_prefix() -> str:
    """Job ids of this module start with this; the etcd user may touch only their keys."""
    return f"tls-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory, job_prefix: str) -> Iterator[SecureEtcd]:
    # --auth-token-ttl 1: etcd forgets a login after one idle second, so the agents' clients
    # must log in again whenever a token lapses (between heartbeats, on watch reconnects).
    with secure_etcd(tmp_path_factory.mktemp("pki"), prefixes=[f"/elastic/{job_prefix}"],
                     extra_args=["--auth-token-ttl", "1"]) as etcd:
        yield etcd


def _clean_env(**extra: str) -> dict[str, str]:
    child = {k: v for k, v in os.environ.items() if k not in _ENV_KEYS}
    child.update(extra)
    return child


def _worker_environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [i.split(b"=", 1) for i in f.read().split(b"\0") if b"=" in i]
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in items}


def test_a_job_with_the_right_certificates_and_credentials_trains_and_leaks_nothing(
    tmp_path: Path, tls_etcd: SecureEtcd, job_prefix: str
) -> None:
    secret = tls_etcd.password
    stop = tmp_path / "stop"
    job = f"{job_prefix}-ok"
    with cluster(tmp_path, tls_etcd.endpoint, job) as c:
        c.env = {k: v for k, v in c.env.items() if k not in _ENV_KEYS}
        c.env.update(tls_etcd.client_env(), LOGLEVEL="DEBUG")
        wargs = c.worker_args("--stop-file", str(stop), steps=100_000)
        agents = [c.start_elastic("--nnodes", "2", "--max-restarts", "0", worker_args=wargs)
                  for _ in range(2)]
        c.wait_for(lambda st: sum(s.world == 2 for s in st) >= 10, 50,
                   "ten steps in a world of 2 over TLS with auth")

        status = run_status(tls_etcd.endpoint, job, env=_clean_env(**tls_etcd.client_env()))
        assert status.returncode == 0, status.stderr
        assert status.world_size == 2
        assert status.member_pids == {a.pid for a in agents}
        assert secret not in status.stdout + status.stderr

        for agent in agents:
            for pid in agent.worker_pids():
                environ = _worker_environ(pid)
                assert secret not in "\0".join(environ.values())
                # Workers never talk to etcd: none of its settings reach them.
                assert not [k for k in environ if k.startswith("ELASTIC_ETCD_")], environ

        stop.touch()
        codes = [agent.wait(40) for agent in agents]
        assert codes == [0, 0], c.logs()
        assert {s.world for s in c.steps()} == {2}
        for agent in agents:
            log = agent.output()
            assert "ELASTIC_ETCD_PASSWORD is not passed on to the workers." in log
            assert secret not in log, f"the password leaked into {agent.log}"


def _bad_start(tmp_path: Path, etcd: SecureEtcd, job: str,
               env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # Deadlines far above the hang guard: the error must come from recognising the refusal,
    # not from retrying until a deadline runs out.
    child = _clean_env(**env, PYTHONPATH=str(REPO), LOGLEVEL="DEBUG")
    argv = [sys.executable, "-m", "launch", "--etcd", etcd.endpoint, "--job-id", job,
            "--nnodes", "1", "--etcd-connect-timeout", "300",
            "--rdzv-conf", "deadline=300,join_timeout=300",
            str(WORKER), "--out", str(tmp_path / "out"), "--ckpt", str(tmp_path / "ckpt")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=90, env=child, cwd=REPO)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("wrong password", "refused the credentials of user 'trainer' (etcdserver: "
         "authentication failed, invalid user ID or password); check ELASTIC_ETCD_USERNAME "
         "and ELASTIC_ETCD_PASSWORD."),
        ("no credentials", "etcd requires authentication; set ELASTIC_ETCD_USERNAME and "
         "ELASTIC_ETCD_PASSWORD."),
        ("wrong CA", "presented a server certificate that {other_ca} does not trust "
         "(certificate verify failed: unable to get local issuer certificate); point "
         "ELASTIC_ETCD_CA_CERT at the CA that signed etcd's certificate."),
        ("no client certificate", "refused this client's TLS certificate (none was given: "),
        ("client certificate with a CN", "etcd's gateway refuses client certificates that "
         "have a CommonName; issue the one in ELASTIC_ETCD_CERT without a CN"),
        ("job outside the user's prefix", "(etcdserver: permission denied); grant the etcd user "
         "read/write access to the job's key prefix (here /elastic/elsewhere-{uid}/generation)."),
    ],
)
def test_wrong_or_missing_credentials_fail_at_once_with_one_sentence(
    tmp_path: Path, tls_etcd: SecureEtcd, job_prefix: str, case: str, expected: str
) -> None:
    pki, uid = tls_etcd.pki, uuid.uuid4().hex[:6]
    env = tls_etcd.client_env()
    job = f"{job_prefix}-bad-{uid}"
    if case == "wrong password":
        env = tls_etcd.client_env(password=_WRONG_PASSWORD)
    elif case == "no credentials":
        del env["ELASTIC_ETCD_USERNAME"], env["ELASTIC_ETCD_PASSWORD"]
    elif case == "wrong CA":
        env["ELASTIC_ETCD_CA_CERT"] = str(pki.other_ca)
    elif case == "no client certificate":
        del env["ELASTIC_ETCD_CERT"], env["ELASTIC_ETCD_KEY"]
    elif case == "client certificate with a CN":
        env["ELASTIC_ETCD_CERT"], env["ELASTIC_ETCD_KEY"] = (str(pki.cn_client_cert),
                                                             str(pki.cn_client_key))
    else:
        job = f"elsewhere-{uid}"
    proc = _bad_start(tmp_path, tls_etcd, job, env)

    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [ln.removeprefix("elastic-run: error: ") for ln in proc.stderr.splitlines()
              if ln.startswith("elastic-run: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"etcd (https://{tls_etcd.endpoint})" in errors[0]
    assert expected.format(other_ca=pki.other_ca, uid=uid) in errors[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert tls_etcd.password not in output
    assert _WRONG_PASSWORD not in output


def test_status_with_a_wrong_password_is_refused_without_echoing_it(
    tls_etcd: SecureEtcd, job_prefix: str
) -> None:
    env = _clean_env(**tls_etcd.client_env(password=_WRONG_PASSWORD))
    status = run_status(tls_etcd.endpoint, f"{job_prefix}-none", env=env)
    assert status.returncode == 3
    assert status.stderr.startswith(
        f"elastic-run: error: etcd (https://{tls_etcd.endpoint}) refused the credentials of "
        "user 'trainer'"
    )
    assert _WRONG_PASSWORD not in status.stdout + status.stderr


@pytest.fixture
def etcd(request: pytest.FixtureRequest) -> Any:
    return etcd_or_skip(request)


def _worker_pids(agents: list[Agent]) -> dict[int, list[int]]:
    return {a.pid: sorted(a.worker_pids()) for a in agents}


def test_two_jobs_on_one_etcd_do_not_disturb_each_other(tmp_path: Path, etcd: Any) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    uid = uuid.uuid4().hex[:8]
    job_a, job_b = f"side-a-{uid}", f"side-b-{uid}"
    stop_a, stop_b = tmp_path / "a" / "stop", tmp_path / "b" / "stop"
    with cluster(tmp_path / "a", etcd.endpoint, job_a) as a, \
            cluster(tmp_path / "b", etcd.endpoint, job_b) as b:
        flags = ("--nnodes", "1:2", "--max-restarts", "0")
        a_agents = [a.start_elastic(*flags, worker_args=a.worker_args(
            "--stop-file", str(stop_a), steps=100_000)) for _ in range(2)]
        b_agents = [b.start_elastic(*flags, worker_args=b.worker_args(
            "--stop-file", str(stop_b), steps=100_000)) for _ in range(2)]
        a.wait_for(lambda st: any(s.world == 2 for s in st), 50, "job A in a world of 2")
        b.wait_for(lambda st: any(s.world == 2 for s in st), 50, "job B in a world of 2")

        status_a, status_b = run_status(etcd.endpoint, job_a), run_status(etcd.endpoint, job_b)
        assert status_a.member_pids == {x.pid for x in a_agents}, status_a.stdout
        assert status_b.member_pids == {x.pid for x in b_agents}, status_b.stdout

        rounds_a = {s.round for s in a.steps() if s.world == 2}
        workers_a = _worker_pids(a_agents)
        victim = b_agents[1]
        victim_workers = victim.worker_pids()
        victim.kill_tree()
        assert not any(alive(p) for p in victim_workers)
        n = len(b.steps())
        b.wait_for(lambda st: any(s.world == 1 for s in st[n:]), 40,
                   "job B's survivor to train alone in a new round")
        n_a = len(a.steps())
        a.wait_for(lambda st: len(st) >= n_a + 10, 20, "job A to go on training")

        # Job B's new round left job A alone: same round, same worker processes.
        assert _worker_pids(a_agents) == workers_a
        assert {s.round for s in a.steps()} == rounds_a, a.steps()[-5:]
        assert {s.world for s in a.steps()} == {2}
        status_b = run_status(etcd.endpoint, job_b)
        assert status_b.member_pids == {b_agents[0].pid}, status_b.stdout
        assert status_b.round > status_a.round or status_b.world_size == 1
        assert run_status(etcd.endpoint, job_a).member_pids == {x.pid for x in a_agents}

        stop_a.touch()
        stop_b.touch()
        codes = [x.wait(40) for x in (*a_agents, b_agents[0])]
        assert codes == [0, 0, 0], a.logs() + b.logs()


def _files_holding(root: Path, secret: bytes) -> list[str]:
    """Regular files under ``root`` whose bytes contain ``secret``."""
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and secret in path.read_bytes():
                found.append(str(path))
        except OSError:
            continue  # removed meanwhile (a temporary file of the job)
    return found


def test_in_place_under_password_auth_heals_a_killed_worker_and_leaks_the_password_nowhere(
    tmp_path: Path, tls_etcd: SecureEtcd, job_prefix: str
) -> None:
    """Acceptance 6 of issue 13: with etcd password auth (as in deploy/), the job runs in place
    (``examples/train.py``, default flags, the manifests' ``--events-dir``); a SIGKILLed worker
    is replaced and healed from a survivor (no checkpoint read), and the password is in no log,
    no process's command line, no worker's environment and no file the job wrote (checkpoints,
    events, audit, and every temporary directory: ``TMPDIR`` points into the test's)."""
    secret = tls_etcd.password.encode()
    temp = tmp_path / "tmp"
    temp.mkdir()
    with cluster(tmp_path, tls_etcd.endpoint, f"{job_prefix}-inplace") as c:
        pki = tls_etcd.pki
        job = ExampleJob(c, tmp_path / "job", steps=300, min_nodes=1, max_nodes=2,
                         etcd=EtcdConfig(endpoints=(tls_etcd.endpoint,), protocol="https",
                                         ca_cert=str(pki.ca), cert=str(pki.client_cert),
                                         key=str(pki.client_key), username=tls_etcd.user,
                                         password=tls_etcd.password))
        c.env.update(tls_etcd.client_env(), TMPDIR=str(temp))
        agents = [job.start_node("--events-dir", str(tmp_path / "events"), step_time=0.1)
                  for _ in range(2)]
        gen = job.trained_in(lambda w, _p: w == 2, "a step in a world of 2")
        job.wait_in_place(2)
        (survivor,) = agents[0].worker_pids()
        (victim,) = agents[1].worker_pids()
        os.kill(victim, signal.SIGKILL)
        gen = job.trained_in(lambda w, pids: w == 2 and victim not in pids,
                             "the killed worker's replacement to train", after_gen=gen)
        assert job.steps_done() < 290, "the job ended before the replacement trained"
        (replacement,) = agents[1].worker_pids()

        processes = [p for a in agents for p in tree(a.pid)]
        for pid in processes:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert secret not in f.read(), f"the password is in process {pid}'s argv"
        ps = subprocess.run(["ps", "-eww", "-o", "pid,args"], capture_output=True,
                            timeout=30, check=True).stdout
        assert secret not in ps
        for pid in (survivor, replacement):
            environ = _worker_environ(pid)
            assert secret.decode() not in "\0".join(environ.values())
            assert not [k for k in environ if k.startswith("ELASTIC_ETCD_")], environ
        assert not _files_holding(tmp_path, secret)  # while the job's temp dirs exist

        assert job.wait_all(agents) == [0, 0], c.logs()
        audit = job.check_audit()

    # In place: the survivor kept its process, the replacement was healed from it.
    healed = [g for g in audit.gens if int(g["pid"]) == replacement]
    assert healed and all(g["received"] and int(g["storage_loads"]) == 0 for g in healed), healed
    assert {int(g["storage_loads"]) for g in audit.gens if int(g["pid"]) == survivor} == {1}
    for agent in agents:
        assert secret.decode() not in agent.output(), f"the password leaked into {agent.log}"
    assert not _files_holding(tmp_path, secret)
