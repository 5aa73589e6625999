"""How processes are launched, without a cluster: the command line `echo2 launch ray` gives the
learner, the one line a machine without the [ray] extra gets, that nothing else in echo2 imports Ray;
and the ports `echo2 worker` is told to serve chunks on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from echo2.cli.launch import learner_arguments


def test_the_learner_gets_the_config_arguments_and_not_the_launchers():
    argv = ["launch", "ray", "--address", "10.0.0.1:6379", "--workers=4", "--steps", "40", "--set", "a.b=1",
            "--run-dir", "runs/x", "--resume", "--max-restarts", "2", "--config", "my.toml",
            "--learner-ranks", "2"]  # fmt: skip
    assert learner_arguments(argv) == ["--steps", "40", "--set", "a.b=1", "--config", "my.toml"]


def test_without_the_ray_extra_one_line_names_it(monkeypatch, capsys):
    from echo2.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # what an install without the extra sees
    assert main(["launch", "ray", "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["echo2 launch: error: echo2 launch ray needs Ray: pip install 'echo2[ray]'"]


@pytest.mark.parametrize("flags", [["--workers", "-1"], ["--max-restarts", "-2"]])
def test_bad_counts_are_named(flags, capsys):
    from echo2.cli import main

    pytest.importorskip("ray")
    assert main(["launch", "ray", *flags]) == 2
    assert "must be >= 0" in capsys.readouterr().err


def test_zero_learner_ranks_are_named(capsys):
    from echo2.cli import main

    pytest.importorskip("ray")
    assert main(["launch", "ray", "--learner-ranks", "0"]) == 2
    assert "ranks >= 1" in capsys.readouterr().err


def test_nothing_but_the_launcher_imports_ray():
    code = (
        "import sys, echo2.cli, echo2.runtime.learner, echo2.runtime.launcher, echo2.runtime.core\n"
        "from echo2.cli import build_parser; build_parser()\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--relay-port", "70000"], "--relay-port 70000: not a TCP port"),
        (["--relay-port", "-1"], "--relay-port -1: not a TCP port"),
        (["--advertise-port", "0"], "--advertise-port 0: not a TCP port"),
        (["--lora-base", "/nonexistent/base"], "--lora-base /nonexistent/base: no such checkpoint directory"),
        (["--uplink-mbps", "-1"], "--uplink-mbps -1.0: Input should be greater than 0"),
        (["--uplink-mbps", "500000"], "--uplink-mbps 500000.0: Input should be less than or equal to 400000"),
        (["--usd-per-hour", "0"], "--usd-per-hour 0.0: Input should be greater than 0"),
        (["--rollouts-per-s", "nan"], "--rollouts-per-s nan: Input should be a finite number"),
    ],
)
def test_a_worker_flag_out_of_bounds_is_refused_naming_it(flags, says, capsys):
    from echo2.cli import main

    assert main(["worker", "--join", "http://127.0.0.1:9", "--token", "t", *flags]) == 2
    assert says in capsys.readouterr().err
