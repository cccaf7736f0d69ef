"""End-to-end fixtures: `loraplex up` as a real subprocess (embedded redis-server, every service a child
process, real ZeroMQ between them, real HTTP in front), on a free port, CPU, tiny model.

One stack is shared by every test that leaves it serving (session scope), to keep CI time low; tests that
stop or restart a stack start their own. Every wait is bounded.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shared.ports import free_port
from shared.probes import alive, descendants, service_pids

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0
UPLOAD_CAP = 2_000_000  # bytes; the session stack's gateway and store both refuse larger uploads (413)
MAX_QUEUE = 48
MAX_RUNNING = 8


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


class Stack:
    """One `loraplex up` process and the HTTP API it serves."""

    def __init__(self, data_dir: Path, *args: str, log_path: Path | None = None, device: str = "cpu"):
        self.data_dir = data_dir
        self.device = device
        self.port = free_port()
        self.args = list(args)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or data_dir.parent / f"launcher-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "Stack":
        cmd = [sys.executable, "-m", "shared.cli", "up", "--data-dir", str(self.data_dir), "--port", str(self.port),
               "--device", self.device, *self.args]
        self.log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while "loraplex.ready" not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {self.proc.returncode}:\n{self.log()[-6000:]}")
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise RuntimeError(f"stack not ready within {timeout_s}s:\n{self.log()[-6000:]}")
            time.sleep(0.2)
        return self

    def log(self) -> str:
        if not self.log_file.closed:  # stop() closes it; the text is still on disk
            self.log_file.flush()
        return self.log_path.read_text(errors="replace")

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60.0), **kw)

    def service_pids(self) -> dict[str, int]:
        return service_pids(self.proc.pid)

    def metrics(self) -> str:
        with self.client() as c:
            return c.get("/metrics").text

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 90.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log_file.close()
        return self.proc.returncode

    def kill_everything(self) -> None:
        """Last-resort cleanup: the launcher and whatever it left."""
        pids = descendants(self.proc.pid) if self.proc and self.proc.poll() is None else []
        for pid in [self.proc.pid, *pids] if self.proc else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="session")
def allowed_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("allowed-root")


@pytest.fixture(scope="session")
def stack(tmp_path_factory, allowed_root):
    """The shared stack: embedded default (tiny model and demo adapters in its data dir), small queue and
    running limits (so overload is reachable), a 2 MB upload cap, path registration under allowed_root."""
    root = tmp_path_factory.mktemp("e2e-stack")
    s = Stack(root / "data", "--allowed-root", str(allowed_root), "--drain-timeout-s", "10",
              "--set", f"scheduler.max_queue={MAX_QUEUE}", "--set", f"worker.max_running_requests={MAX_RUNNING}",
              "--set", f"gateway.max_upload_bytes={UPLOAD_CAP}", "--set", f"store.max_upload_bytes={UPLOAD_CAP}",
              "--set", "scheduler.first_token_slo_s=0", "--heartbeat-timeout-s", "10")
    try:
        s.start()
        yield s
    finally:
        s.stop()
        s.kill_everything()


@pytest.fixture(scope="session")
def model_dir(stack) -> Path:
    return stack.data_dir / "model"


@pytest.fixture(scope="session")
def mixed_adapters(stack, model_dir, tmp_path_factory) -> dict[str, Path]:
    """Eight adapters of mixed ranks and target modules, uploaded to the shared stack: name -> folder."""
    from shared.make_adapters import make_adapters

    out = tmp_path_factory.mktemp("mixed-adapters")
    folders = make_adapters(out / "all", model_dir, 4, ranks=[4, 8, 16, 32], seed=11, prefix="mixed-all")
    folders += make_adapters(out / "attn", model_dir, 4, ranks=[2, 64, 8, 24], seed=12, prefix="mixed-attn",
                             targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    with stack.client() as c:
        for folder in folders:
            r = upload(c, folder, folder.name)
            assert r.status_code in (200, 201), r.text
    return {f.name: f for f in folders}


def upload(client: httpx.Client, folder: Path, name: str, config: bytes | None = None, weights: bytes | None = None):
    files = {
        "adapter_config": ("adapter_config.json", config if config is not None else (folder / "adapter_config.json").read_bytes(),
                           "application/json"),
        "adapter_model": ("adapter_model.safetensors",
                          weights if weights is not None else (folder / "adapter_model.safetensors").read_bytes(),
                          "application/octet-stream"),
    }
    return client.post("/v1/adapters", data={"name": name}, files=files)
