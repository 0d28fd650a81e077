"""Parsing and validation of the elastic-run command line (no processes, no etcd)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elastic.errors import ConfigError
from launch import cli
from launch.runner import guarded_command


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ELASTIC_ETCD_ENDPOINTS", "ELASTIC_RUN_ID", "PET_RDZV_BACKEND", "PET_NNODES",
                 "PET_MIN_NODES", "PET_MAX_NODES", "PET_RDZV_ENDPOINT", "PET_RDZV_ID"):
        monkeypatch.delenv(name, raising=False)


def test_our_flags_map_onto_torchrun_rendezvous_settings(script: str) -> None:
    args = cli.parse_args(["--min-nodes", "2", "--max-nodes", "3", "--nproc-per-node", "1",
                           "--etcd", "127.0.0.1:2379", "--job-id", "j1", script, "--lr", "1"])
    assert args.nnodes == "2:3"
    assert args.rdzv_backend == "elastic-etcd-v3"
    assert args.rdzv_endpoint == "127.0.0.1:2379"
    assert args.rdzv_id == "j1"
    assert args.training_script == script
    assert args.training_script_args == ["--lr", "1"]


def test_torchrun_flags_still_work(script: str) -> None:
    args = cli.parse_args(["--nnodes", "1:4", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint",
                           "h1:2379,h2:2379", "--rdzv-id", "x", "--max-restarts", "5", script])
    assert (args.min_nodes, args.max_nodes) == (1, 4)
    assert args.rdzv_endpoint == "h1:2379,h2:2379"
    assert args.rdzv_id == "x"
    assert args.max_restarts == 5


def test_min_nodes_alone_raises_max_to_match(script: str) -> None:
    args = cli.parse_args(["--min-nodes", "3", "--etcd", "h:1", script])
    assert args.nnodes == "3:3"


def test_endpoints_come_from_the_environment(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_ETCD_ENDPOINTS", "10.0.0.1:2379")
    monkeypatch.setenv("ELASTIC_RUN_ID", "from-env")
    args = cli.parse_args([script])
    assert args.rdzv_endpoint == "10.0.0.1:2379"
    assert args.rdzv_id == "from-env"


def test_pet_variables_override_our_defaults(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd-v3")
    monkeypatch.setenv("PET_NNODES", "2:5")
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")
    args = cli.parse_args(["--rdzv-endpoint", "127.0.0.1:29400", script])
    assert args.rdzv_backend == "etcd-v3"
    assert args.nnodes == "2:5"
    assert args.max_restarts == 7


def test_defaults_give_every_node_a_crash_budget(script: str) -> None:
    args = cli.parse_args(["--etcd", "127.0.0.1:2379", script])
    assert args.max_restarts == 3 and args.restart_window == 3600


def test_torchs_own_backends_are_refused_with_one_sentence(script: str) -> None:
    with pytest.raises(ConfigError, match=r"^--rdzv-backend \(c10d\) is not elastic-run's; its "
                       r"agent speaks its own etcd protocol, so drop the flag \(torch's "
                       r"backends work with torchrun\)\.$"):
        cli.parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", script])


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_nproc_per_node_is_refused_before_anything_starts(script: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^--nproc-per-node \({value}\) must be a positive "
                       r"number of workers per node \(or auto, cpu, gpu\); pass for example "
                       r"--nproc-per-node 1\.$"):
        cli.parse_args(["--etcd", "h:1", "--nproc-per-node", value, script])


def test_standalone_uses_our_backend_and_a_fresh_job_id(script: str) -> None:
    args = cli.parse_args(["--standalone", "--nproc-per-node", "2", script])
    assert args.rdzv_backend == "elastic-etcd-v3"
    assert args.rdzv_id.startswith("standalone-")


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (
            ["--min-nodes", "3", "--max-nodes", "2"],
            r"--min-nodes \(3\) must not exceed --max-nodes \(2\)",
        ),
        (["--nnodes", "two"], r"--nnodes \('two'\) is not N or MIN:MAX"),
        (["--etcd", "localhost"], r"etcd endpoint \('localhost'\) is not host:port"),
        (["--etcd", "h:99999"], r"etcd endpoint \('h:99999'\) is not host:port"),
        ([], r"no etcd endpoint given"),
        (["--etcd", "a:1", "--rdzv-endpoint", "b:1"], r"--etcd \(a:1\) and --rdzv-endpoint"),
        (["--etcd", "a:1", "--max-restarts", "-1"], r"--max-restarts \(-1\) must be at least 0"),
        (["--etcd", "a:1", "--job-id", "a/b"], r"the job id \('a/b'\) must be non-empty, "
         r"without '/'"),
        (["--etcd", "a:1", "--rdzv-id", " x"], r"the job id \(' x'\) must be"),
        (["--standalone", "--job-id", "team/exp"], r"the job id \('team/exp'\)"),
        (["--standalone", "--warm-standby", "yes"],
         r"^--warm-standby \('yes'\) must be 'auto', 'on' or 'off'"),
        (["--standalone", "--memory-checkpoints", "1"],
         r"^--memory-checkpoints \('1'\) must be 'on' or 'off'"),
    ],
)
def test_bad_input_is_one_sentence_naming_the_value(
    script: str, argv: list[str], pattern: str
) -> None:
    with pytest.raises(ConfigError, match=pattern) as info:
        cli.parse_args([*argv, script])
    assert str(info.value).count(". ") == 0 and str(info.value).endswith(".")


def test_a_job_id_from_the_environment_is_checked_too(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_RUN_ID", "a/b")
    with pytest.raises(ConfigError, match=r"the job id \('a/b'\)"):
        cli.parse_args(["--etcd", "h:1", script])


def test_missing_script_is_reported_by_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.py")
    with pytest.raises(ConfigError, match=re.escape(f"training script ({missing}) does not exist")):
        cli.parse_args(["--etcd", "h:1", missing])


def test_main_returns_2_and_prints_the_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["--min-nodes", "3", "--max-nodes", "2", "--etcd", "h:1", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(r"^elastic-run: error: --min-nodes \(3\) must not exceed", err, re.M)


def test_python_scripts_run_under_the_worker_guard() -> None:
    import sys

    cmd, args = guarded_command(sys.executable, ["-u", "train.py", "--x"])
    assert cmd == sys.executable
    assert args[:3] == ["-u", "-m", "launch.worker_guard"]
    assert args[3:] == ["train.py", "--x"]


def test_modules_and_executables_run_under_the_worker_guard() -> None:
    import sys

    _, margs = guarded_command(sys.executable, ["-u", "-m", "pkg.train"])
    assert margs == ["-u", "-m", "launch.worker_guard", "-m", "pkg.train"]
    cmd, xargs = guarded_command("/bin/trainer", ["--a"])
    assert cmd == sys.executable
    assert xargs == ["-u", "-m", "launch.worker_guard", "--exec", "/bin/trainer", "--a"]


def test_metrics_are_off_by_default_and_the_port_comes_from_flag_or_environment(
    script: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ELASTIC_METRICS_PORT", raising=False)
    base = ["--standalone", script]
    assert cli.parse_args(base).metrics_port is None
    assert cli.parse_args(["--metrics-port", "9400", *base]).metrics_port == 9400
    monkeypatch.setenv("ELASTIC_METRICS_PORT", "9401")
    monkeypatch.setenv("ELASTIC_METRICS_HOST", "::")
    args = cli.parse_args(base)
    assert (args.metrics_port, args.metrics_host) == (9401, "::")


def test_a_bad_metrics_port_is_one_sentence_naming_it(
    script: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match=r"^--metrics-port \(70000\) must be a port number"):
        cli.parse_args(["--standalone", "--metrics-port", "70000", script])
    monkeypatch.setenv("ELASTIC_METRICS_PORT", "nine")
    with pytest.raises(ConfigError, match=r"^ELASTIC_METRICS_PORT \('nine'\) is not a port"):
        cli.parse_args(["--standalone", script])


def test_the_restart_caches_are_on_by_default_and_turn_off_by_flag_or_environment(
    script: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ELASTIC_WARM_STANDBY", raising=False)
    monkeypatch.delenv("ELASTIC_MEMORY_CHECKPOINTS", raising=False)
    base = ["--standalone", script]
    args = cli.parse_args(base)
    assert (args.warm_standby, args.memory_checkpoints) == ("auto", "on")
    args = cli.parse_args(["--warm-standby", "on", *base])
    assert args.warm_standby == "on"
    args = cli.parse_args(["--warm-standby", "off", "--memory-checkpoints", "off", *base])
    assert (args.warm_standby, args.memory_checkpoints) == ("off", "off")
    monkeypatch.setenv("ELASTIC_WARM_STANDBY", "off")
    monkeypatch.setenv("ELASTIC_MEMORY_CHECKPOINTS", "off")
    args = cli.parse_args(base)
    assert (args.warm_standby, args.memory_checkpoints) == ("off", "off")
    monkeypatch.setenv("ELASTIC_WARM_STANDBY", "maybe")
    with pytest.raises(ConfigError, match=r"^--warm-standby \('maybe'\) must be"):
        cli.parse_args(base)


def test_events_dir_takes_a_url(script: str) -> None:
    args = cli.parse_args(["--standalone", "--events-dir", "s3://bucket/job/events", script])
    assert args.events_dir == "s3://bucket/job/events"


def test_the_shutdown_grace_is_torchruns_flag_or_30_s_where_torch_has_no_such_field() -> None:
    from types import SimpleNamespace

    from launch.runner import _shutdown_timeout

    assert _shutdown_timeout(SimpleNamespace(shutdown_timeout=7)) == 7.0
    assert _shutdown_timeout(SimpleNamespace(shutdown_timeout=None)) == 30.0
    # torch 2.11's LaunchConfig has no shutdown_timeout (found on the GPU machine).
    assert _shutdown_timeout(SimpleNamespace()) == 30.0
