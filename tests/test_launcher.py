"""The launcher's supervision with real child processes: dying with the parent, restarts, hang detection,
crash-loop give-up, cleanup of a crashed store's arena, and configuration errors that name the problem."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from services.launcher import MAX_DEATHS, Launcher, arena_unlink
from services.launcher_children import Child, stop_children
from services.launcher_config import LauncherConfig, parse_args, service_extra
from shared.probes import alive

REPO = Path(__file__).resolve().parents[1]


def wait_for(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_children_die_with_a_sigkilled_parent(tmp_path):
    """`sleep` has no parent watch of its own: only the kernel's parent-death signal can end it."""
    pid_file = tmp_path / "grandchild.pid"
    script = textwrap.dedent(f"""
        import time
        from services.launcher_children import Child
        child = Child("sleeper", ["sleep", "120"], ready=lambda c: True)
        child.start()
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(120)
    """)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": path})
    try:
        assert wait_for(lambda: pid_file.is_file() and pid_file.read_text(), 30)
        grandchild = int(pid_file.read_text())
        assert alive(grandchild)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_for(lambda: not alive(grandchild), 10), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()


def launcher_with(tmp_path, *children: Child) -> Launcher:
    launcher = Launcher(LauncherConfig(data_dir=str(tmp_path), heartbeat_timeout_s=0.5, ready_timeout_s=5))
    launcher.exit_code = 0
    launcher.children = list(children)
    return launcher


def test_a_stop_signal_sets_flags_without_logging_and_a_second_one_kills_every_child(tmp_path):
    # A signal handler runs between two bytecodes of the main thread, maybe inside a log write that holds
    # the log's lock; a handler that logs would then wait forever. So the handler must not log at all.
    import io

    from shared.log import configure_logging

    child = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], ready=lambda c: True)
    launcher = launcher_with(tmp_path, child)
    child.start()
    written = io.StringIO()
    configure_logging(stream=written)
    try:
        launcher.request_stop(signal.SIGTERM, None)
        assert launcher.stop_requested and not launcher.force_stop and child.running()
        launcher.request_stop(signal.SIGINT, None)  # a second Ctrl-C: stop at once
        assert launcher.force_stop
        assert wait_for(lambda: not child.running(), 5)
        assert written.getvalue() == "", "the handler logged"
        launcher.stop()  # the main thread logs what was asked
        assert "launcher.stopping" in written.getvalue() and "SIGTERM" in written.getvalue()
        assert "launcher.stop_now" in written.getvalue()
    finally:
        configure_logging()
        stop_children([child], 5)


def test_a_dead_child_is_restarted(tmp_path):
    child = Child("flaky", [sys.executable, "-c", "import time; time.sleep(0.2)"], ready=lambda c: True)
    launcher = launcher_with(tmp_path, child)
    child.start()
    child.wait_ready(5)
    first = child.pid
    assert wait_for(lambda: not child.running(), 10)
    launcher.check(child)
    assert child.pid != first and child.running()
    assert not launcher.stop_requested
    stop_children([child], 5)


def test_a_crash_loop_stops_the_stack(tmp_path):
    child = Child("broken", [sys.executable, "-c", "import sys; sys.exit(3)"], ready=lambda c: True)
    launcher = launcher_with(tmp_path, child)
    child.start()
    for _ in range(MAX_DEATHS + 1):
        assert wait_for(lambda: not child.running(), 10)
        launcher.check(child)
    assert launcher.stop_requested and launcher.exit_code == 1
    assert child.proc.returncode == 3


def test_a_hung_child_is_killed_and_restarted(tmp_path):
    heartbeat = tmp_path / "beat"
    heartbeat.write_text("x")
    child = Child("hung", ["sleep", "60"], ready=lambda c: True,
                  alive_check=lambda c: time.time() - heartbeat.stat().st_mtime < 0.5)
    launcher = launcher_with(tmp_path, child)
    child.start()
    child.wait_ready(5)
    first = child.pid
    launcher.check(child)
    assert child.pid == first  # heartbeat fresh: left alone
    time.sleep(0.6)
    launcher.check(child)
    assert child.pid != first and not alive(first)
    os.utime(heartbeat)
    stop_children([child], 5)


def test_a_crashed_store_leaves_no_arena_behind(tmp_path):
    child = Child("adapter_store", ["sleep", "60"], ready=lambda c: True)
    child.start()
    shm = shared_memory.SharedMemory(name=f"loraplex-arena-{child.pid}", create=True, size=4096)
    shm.close()
    child.signal(signal.SIGKILL)
    child.wait(5)
    arena_unlink(child)
    assert not Path(f"/dev/shm/loraplex-arena-{child.pid}").exists()
    from multiprocessing import resource_tracker

    resource_tracker.unregister(shm._name, "shared_memory")  # already unlinked; nothing for the tracker to do


def test_startup_fails_fast_when_a_child_exits(tmp_path):
    child = Child("doomed", [sys.executable, "-c", "import sys; sys.exit(7)"], ready=lambda c: False)
    child.start()
    started = time.monotonic()
    with pytest.raises(Exception, match="doomed exited with status 7"):
        child.wait_ready(30)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("argv, message", [
    (["--model", "a", "--dummy-weights", "b"], "at most one of --model and --dummy-weights"),
    (["--set", "scheduler.max_queue"], "SERVICE.FLAG=VALUE"),
    (["--set", "nosuch.flag=1"], "SERVICE.FLAG=VALUE"),
    (["--workers", "0"], "--workers and --tp must be at least 1"),
    (["--device", "tpu"], "--device must be cuda or cpu"),
])
def test_bad_arguments_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_set_passes_flags_to_one_service():
    assert service_extra("scheduler.max_queue=4") == ("scheduler", "--max-queue", "4")
    assert service_extra("worker.max_running_requests=8") == ("gpu_worker", "--max-running-requests", "8")
    assert service_extra("store.max_upload_bytes=10") == ("adapter_store", "--max-upload-bytes", "10")
    # A value may hold '=' itself: only the first one ends the flag's name.
    assert service_extra("worker.kernel_shapes=attention_block_n=64,split_mixed") == (
        "gpu_worker", "--kernel-shapes", "attention_block_n=64,split_mixed")


def test_every_service_accepts_the_flags_the_launcher_gives_it(tmp_path):
    """Each service's own argument parser takes the launcher's command line (as `--help` would show)."""
    from services.launcher_commands import Topology, service_commands

    config = LauncherConfig(model=str(tmp_path), data_dir=str(tmp_path), allowed_root=str(tmp_path),
                            api_keys_file=str(tmp_path / "keys.json"), log_json=True)
    t = Topology("redis://127.0.0.1:1/0", "tcp://127.0.0.1:1", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2",
                 "tcp://127.0.0.1:2", "tcp://127.0.0.1:3", "tcp://127.0.0.1:3", str(tmp_path), str(tmp_path),
                 str(tmp_path))
    from services.adapter_store.config import StoreConfig
    from services.gateway.config import GatewayConfig
    from services.gpu_worker.worker_config import parse_args as worker_args
    from services.scheduler.config import SchedulerConfig

    parsers = {"adapter_store": StoreConfig.from_args, "scheduler": SchedulerConfig.from_args,
               "worker-0": worker_args, "gateway": GatewayConfig.from_args}
    for name, argv in service_commands(config, t, "cpu", "float32", 4096).items():
        assert argv[0] == "-m"
        parsers[name](argv[2:])  # raises SystemExit on an unknown flag


def test_set_gives_a_boolean_setting_its_value(tmp_path, capsys):
    """`--set worker.overlap_steps=true` reaches the worker's engine config; on/off words both ways."""
    from services.launcher_commands import Topology, service_commands
    from services.gpu_worker.worker_config import parse_args as worker_args

    t = Topology("redis://127.0.0.1:1/0", "tcp://127.0.0.1:1", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2",
                 "tcp://127.0.0.1:2", "tcp://127.0.0.1:3", "tcp://127.0.0.1:3", str(tmp_path), str(tmp_path),
                 str(tmp_path))
    for words, overlap, graphs in ((["worker.overlap_steps=true", "worker.cuda_graphs=off"], True, False),
                                   (["worker.overlap_steps=False", "worker.cuda_graphs=1"], False, True)):
        config = LauncherConfig(model=str(tmp_path), data_dir=str(tmp_path), set=words)
        argv = service_commands(config, t, "cpu", "float32", 4096)["worker-0"]
        _, engine = worker_args(argv[2:])
        assert (engine.overlap_steps, engine.cuda_graphs) == (overlap, graphs)
    # The flag alone and its --no- form still work; a word that is not a boolean names the flag.
    model = ["--model", str(tmp_path)]
    assert worker_args(model + ["--overlap-steps"])[1].overlap_steps is True
    assert worker_args(model + ["--no-cuda-graphs"])[1].cuda_graphs is False
    with pytest.raises(SystemExit):
        worker_args(model + ["--overlap-steps", "maybe"])
    assert "--overlap-steps" in capsys.readouterr().err


def test_a_model_folder_without_its_files_is_refused_by_name(tmp_path, capsys):
    from services.launcher import main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert main(["--model", str(tmp_path / "model"), "--data-dir", str(tmp_path / "data"), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "missing tokenizer.json" in err and "--model" in err


@pytest.mark.parametrize("service", ["launcher", "adapter_store", "scheduler", "gpu_worker", "gateway"])
def test_every_command_line_prints_its_help(service, capsys):
    """--help lists every setting; docs that quote a percentage must not break argparse's %-formatting."""
    from services.adapter_store.config import StoreConfig
    from services.gateway.config import GatewayConfig
    from services.gpu_worker.worker_config import parse_args as worker_args
    from services.scheduler.config import SchedulerConfig

    parse = {"launcher": parse_args, "adapter_store": StoreConfig.from_args, "scheduler": SchedulerConfig.from_args,
             "gpu_worker": worker_args, "gateway": GatewayConfig.from_args}[service]
    with pytest.raises(SystemExit) as exited:
        parse(["--help"])
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out
