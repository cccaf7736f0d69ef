"""The `loraplex` command line: a lazily imported table of subcommands, clear usage errors."""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared import cli

# The source tree, importable from any working directory whether or not the package is installed.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}


def loraplex(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=ENV)


def test_every_registered_command_resolves_to_a_function():
    assert {"make-model", "make-adapters"} <= set(cli.COMMANDS)
    for name in cli.COMMANDS:
        assert callable(cli.resolve(name)), name


def test_help_lists_the_commands_without_importing_torch():
    probe = ("import sys, contextlib, io\n"
             "from shared.cli import main\n"
             "out = io.StringIO()\n"
             "with contextlib.redirect_stdout(out):\n"
             "    try: main(['--help'])\n"
             "    except SystemExit as e: assert e.code == 0\n"
             "print(out.getvalue())\n"
             "print('torch imported:', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 0, done.stderr
    for name, (_, summary) in cli.COMMANDS.items():
        assert name in done.stdout and summary in done.stdout
    assert "torch imported: False" in done.stdout


def test_command_help_comes_from_the_command_module():
    done = loraplex("make-adapters", "--help")
    assert done.returncode == 0
    assert "usage: loraplex make-adapters" in done.stdout and "--ranks" in done.stdout and "--targets" in done.stdout


USAGE_ERRORS = [
    ((), "the following arguments are required: COMMAND"),
    (("serve-everything",), "invalid choice: 'serve-everything'"),
    (("make-model",), "the following arguments are required: dir"),
    (("make-model", "x", "--preset", "huge"), "invalid choice: 'huge'"),
    (("make-adapters", "out", "--count", "2"), "the following arguments are required: --base"),
    (("make-adapters", "out", "--base", "nowhere", "--count", "2"), "--base nowhere: no config.json there"),
    (("make-adapters", "out", "--base", ".", "--count", "2", "--ranks", "8,x"), "expected comma-separated integers"),
    (("make-adapters", "out", "--base", ".", "--count", "2", "--targets", "q_proj,lm_head"),
     "unknown target module(s) lm_head"),
]


@pytest.mark.parametrize("args, message", USAGE_ERRORS)
def test_usage_errors_exit_2_with_a_clear_message(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main(list(args))
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_usage_error_from_a_real_process(tmp_path):
    done = loraplex("make-adapters", "out", "--base", "nowhere", "--count", "2", cwd=tmp_path)
    assert done.returncode == 2 and "no config.json there" in done.stderr


def test_count_must_be_positive(tiny_model_dir, tmp_path):
    done = loraplex("make-adapters", str(tmp_path / "out"), "--base", str(tiny_model_dir), "--count", "0")
    assert done.returncode == 2 and "--count must be at least 1" in done.stderr
    assert not (tmp_path / "out").exists()


def test_console_script_is_declared_and_runs():
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("loraplex") == "shared.cli:main", "install the package first (the README's test command does)"
    exe = shutil.which("loraplex")
    assert exe is not None, "loraplex entry point is installed but not on PATH"
    done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "make-adapters" in done.stdout
