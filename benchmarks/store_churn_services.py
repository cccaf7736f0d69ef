"""The processes benchmarks/store_churn.py measures and the plain requests it makes to them, kept apart from
the churn driver so that file holds only what is measured and reported: Redis and one adapter_store on fresh
state (children that die with the benchmark), waiting for the store to answer, and registering a population
by server path."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import zmq

from bench import REPO, child_env
from services.launcher_children import die_with_parent
from services.launcher_redis import redis_command, redis_ping
from shared.ports import free_port
from services.adapter_store.client import StoreClient
from shared.wire import AdapterRegistered, Ping, Pong, RegisterAdapter, StoreError, decode, encode

# Registrations sent before their answers are read: enough to keep the store's registration threads busy.
REGISTER_WINDOW = 32
REGISTER_STALL_S = 300.0
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


# ---- processes ----------------------------------------------------------------------------------------

def _stop(proc: subprocess.Popen | None, timeout_s: float = STOP_TIMEOUT_S) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class Services:
    """Redis and one adapter store on fresh state under `run_dir`; stop() undoes everything start() did."""

    def __init__(self, run_dir: Path, model_dir: Path, allowed_root: Path, arena_bytes: int, dtype: str,
                 load_threads: int | None, log_path: Path):
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.allowed_root = allowed_root
        self.arena_bytes = arena_bytes
        self.dtype = dtype
        self.load_threads = load_threads
        self.log_path = log_path
        self.arena_name = f"lpx-churn-{uuid.uuid4().hex[:12]}"
        self.address = ""
        self.redis: subprocess.Popen | None = None
        self.store: subprocess.Popen | None = None
        self._log_file = None

    def start(self) -> None:
        redis_dir = self.run_dir / "redis"
        redis_dir.mkdir(parents=True)
        port = free_port()
        self.redis = subprocess.Popen(redis_command(redis_dir, port, "always"), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, preexec_fn=die_with_parent(os.getpid()))
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 30
        while not self._redis_up(url):
            if self.redis.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; see {redis_dir / 'redis.log'}")
            time.sleep(0.05)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        flags = {"--bind": self.address, "--redis-url": url, "--data-dir": str(self.run_dir / "store"),
                 "--model-dir": str(self.model_dir), "--dtype": self.dtype, "--arena-bytes": str(self.arena_bytes),
                 "--arena-name": self.arena_name, "--allowed-root": str(self.allowed_root)}
        if self.load_threads is not None:
            flags["--load-threads"] = str(self.load_threads)
        cmd = [sys.executable, "-m", "services.adapter_store", *[x for kv in flags.items() for x in kv]]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")
        self.store = subprocess.Popen(cmd, cwd=REPO, stdout=self._log_file, stderr=subprocess.STDOUT,
                                      env=child_env(PYTHONUNBUFFERED="1"), preexec_fn=die_with_parent(os.getpid()))

    @staticmethod
    def _redis_up(url: str) -> bool:
        import redis

        try:
            return redis_ping(url)
        except (redis.RedisError, OSError):  # refused or still loading: not up yet
            return False

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def read_bytes(self) -> int | None:
        """Bytes the store has read through read(2) so far (/proc/PID/io rchar), or None if unreadable."""
        try:
            for line in Path(f"/proc/{self.store.pid}/io").read_text().splitlines():
                if line.startswith("rchar:"):
                    return int(line.split()[1])
        except (OSError, AttributeError):
            return None
        return None

    def stop(self) -> None:
        _stop(self.store)
        if self._log_file is not None:
            self._log_file.close()
        # A store that had to be killed leaves its arena segment behind.
        Path("/dev/shm", self.arena_name).unlink(missing_ok=True)
        _stop(self.redis)


# ---- talking to the store -----------------------------------------------------------------------------

def dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def wait_ready(control: StoreClient, services: Services) -> Pong:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if services.store.poll() is not None:
            raise RuntimeError(f"adapter store exited with {services.store.returncode}:\n{services.log_tail()}")
        try:
            return control.call(Ping(), 1.0)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"adapter store not ready in {START_TIMEOUT_S:g}s:\n{services.log_tail()}") from None


def register_all(control: StoreClient, root: Path, names: list[str], progress: bool) -> float:
    """Register every name by its folder's server path, REGISTER_WINDOW at a time on the client's socket (its
    one-at-a-time `call` would leave the store's registration threads idle); seconds taken."""
    sock = control.socket
    from tqdm import tqdm

    started = time.monotonic()
    todo = list(reversed(names))
    waiting: set[str] = set()
    failed: dict[str, str] = {}
    with tqdm(total=len(names), desc="register", unit="adapter", disable=not progress) as bar:
        while todo or waiting:
            while todo and len(waiting) < REGISTER_WINDOW:
                name = todo.pop()
                sock.send_multipart(encode(RegisterAdapter(name, path=str(root / name), call_id=name)))
                waiting.add(name)
            if not sock.poll(int(REGISTER_STALL_S * 1000)):
                raise RuntimeError(f"adapter store answered no registration in {REGISTER_STALL_S:g}s "
                                   f"({len(waiting)} waiting)")
            reply = decode(sock.recv_multipart())
            name = reply.call_id
            if name not in waiting:
                continue
            waiting.discard(name)
            if isinstance(reply, StoreError):
                failed[name] = f"{reply.status} {reply.code}: {reply.message}"
            elif not isinstance(reply, AdapterRegistered):
                failed[name] = f"unexpected reply {type(reply).__name__}"
            bar.update(1)
    if failed:
        first = next(iter(failed.items()))
        raise RuntimeError(f"{len(failed)} registration(s) failed, e.g. {first[0]}: {first[1]}")
    return time.monotonic() - started
