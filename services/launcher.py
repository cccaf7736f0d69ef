"""`loraplex up`: start every service as a child process, wait until each is ready, supervise, drain and stop.

    1) prepare   data dir; the demo model and adapters when no model is given; free internal ports
    2) start     redis (embedded unless --redis-url) -> adapter_store -> scheduler -> worker(s) -> gateway,
                 each waited for (ready signal, with a timeout, failing fast if it exits)
    3) supervise a child that exits is restarted (a worker whose heartbeat stops is killed first); the
                 scheduler requeues a dead worker's requests that streamed nothing and fails the others cleanly
    4) stop      on Ctrl-C / SIGTERM: the gateway and scheduler drain (new requests 503, in-flight ones finish
                 within the drain timeout), then workers, store and redis stop; a second Ctrl-C stops at once
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import zmq

from shared.log import configure_logging, get_logger
from shared.ports import EXIT_ADDRESS_IN_USE, free_ports

from .launcher_children import Child, ChildFailed, stop_children
from .launcher_commands import Topology, model_dir_of, service_commands
from .launcher_config import LauncherConfig, parse_args
from .launcher_redis import redis_command, redis_log_size, redis_ping, redis_port_taken

log = get_logger("launcher")

# A child that dies this many times within CRASH_WINDOW_S is not restarted again: the stack stops instead of
# spinning on a configuration error.
MAX_DEATHS = 5
CRASH_WINDOW_S = 60.0
SUPERVISE_PERIOD_S = 0.1
PORT_ATTEMPTS = 3  # startups on fresh ports when a chosen one turns out to be taken


def zmq_ping(addr: str, timeout_s: float = 0.5) -> bool:
    """A Ping answered by a Pong on `addr` (the store's socket, the scheduler's worker socket)."""
    from shared.wire import Ping, Pong, decode, encode

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send_multipart(encode(Ping(call_id="launcher")))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000) + 1):
            msg = decode(sock.recv_multipart())
            if isinstance(msg, Pong):
                return True
        return False
    finally:
        sock.close(0)


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    import httpx

    return httpx.get(url, timeout=timeout_s).status_code == 200


def worker_ready_file(child: Child) -> Path:
    return Path(child.argv[child.argv.index("--ready-file") + 1])


def worker_ready(child: Child) -> bool:
    path = worker_ready_file(child)
    return path.is_file() and path.read_text().strip() == str(child.pid)


def clear_worker_ready(child: Child) -> None:
    worker_ready_file(child).unlink(missing_ok=True)


def arena_unlink(child: Child) -> None:
    """The store names its arena after its pid and unlinks it on a clean exit; after a crash it is left in
    /dev/shm, where only the launcher still knows its name."""
    if child.pid is not None:
        try:
            os.unlink(f"/dev/shm/loraplex-arena-{child.pid}")
            log.info("arena.unlinked", segment=f"loraplex-arena-{child.pid}")
        except FileNotFoundError:
            pass


def check_model_dir(folder: Path, config: LauncherConfig) -> None:
    """Refuse at once, naming the file, a model folder the services would each fail on later."""
    flag = "--model" if config.model else "--dummy-weights"
    missing = [f for f in ("config.json", "tokenizer.json") if not (folder / f).is_file()]
    if missing:
        raise RuntimeError(f"{flag} {folder}: missing {', '.join(missing)} (the workers read config.json, the "
                           f"gateway tokenizes with tokenizer.json)")


class Launcher:
    def __init__(self, config: LauncherConfig):
        self.config = config
        self.data_dir = config.data_path
        self.children: list[Child] = []
        self.stop_requested = False
        self.force_stop = False
        self.stop_signal: int | None = None  # the signal that asked for the stop (logged by `stop`)
        self.demo_folders: list[Path] = []
        self.redis_log_start = 0  # where the embedded Redis's log lines of this start begin

    # ---- 1) prepare ------------------------------------------------------------------------------
    def device(self) -> str:
        if self.config.device:
            return self.config.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def prepare(self) -> None:
        cfg = self.config
        self.data_dir.mkdir(parents=True, exist_ok=True)
        run_dir = self.data_dir / "run"
        run_dir.mkdir(exist_ok=True)
        if cfg.embedded_default:
            from .launcher_demo import prepare_demo

            _, self.demo_folders = prepare_demo(self.data_dir, cfg.demo_adapters)
        check_model_dir(Path(model_dir_of(cfg, self.data_dir)), cfg)
        device = self.device()
        on_cuda = device.startswith("cuda")
        dtype = cfg.dtype or ("bfloat16" if on_cuda else "float32")
        num_slots = cfg.num_slots or (0 if on_cuda else 4096)
        # Redis and the three ZeroMQ endpoints: four distinct ports, none of them the HTTP port.
        redis_port, *ports = free_ports(4, exclude={cfg.port})
        redis_url = cfg.redis_url or f"redis://127.0.0.1:{redis_port}/0"
        addr = [f"tcp://127.0.0.1:{p}" for p in ports]
        topo = Topology(
            redis_url=redis_url, store_bind=addr[0], store_addr=addr[0],
            scheduler_gateway_bind=addr[1], scheduler_gateway_addr=addr[1],
            scheduler_worker_bind=addr[2], scheduler_worker_addr=addr[2],
            data_dir=str(self.data_dir), model_dir=model_dir_of(cfg, self.data_dir), run_dir=str(run_dir),
        )
        self.topology = topo
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Services import the `services` and `shared` packages: from the install, or from this source tree.
        source_root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH", "")) if p)
        py = sys.executable

        if not cfg.redis_url:
            redis_dir = self.data_dir / "redis"
            redis_dir.mkdir(exist_ok=True)
            self.redis_log_start = redis_log_size(redis_dir)
            self.children.append(Child("redis", redis_command(redis_dir, redis_port),
                                       ready=lambda c: redis_ping(redis_url), env=env))
        commands = service_commands(cfg, topo, device, dtype, num_slots)
        hooks = {
            "adapter_store": dict(ready=lambda c: zmq_ping(topo.store_addr), after_exit=arena_unlink),
            "scheduler": dict(ready=lambda c: zmq_ping(topo.scheduler_worker_addr)),
            "gateway": dict(ready=lambda c: http_ok(f"{self.base_url}/health")),
        }
        worker_hooks = dict(ready=worker_ready, before_start=clear_worker_ready, alive_check=self.worker_alive)
        for name, argv in commands.items():
            self.children.append(Child(name, [py, *argv], env=env, **hooks.get(name, worker_hooks)))

    @property
    def base_url(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.config.port}"

    def worker_alive(self, child: Child) -> bool:
        """A ready worker refreshes its ready file every heartbeat; a stale one is hung (or stopped)."""
        try:
            age = time.time() - worker_ready_file(child).stat().st_mtime
        except FileNotFoundError:
            return True  # restarted and not ready yet: the startup deadline covers it
        return age < self.config.heartbeat_timeout_s

    # ---- 2) start --------------------------------------------------------------------------------
    def start(self) -> None:
        for child in self.children:
            child.start()
            child.wait_ready(self.config.ready_timeout_s, cancelled=lambda: self.stop_requested)
        self.wait_stack_ready()
        if self.demo_folders:
            from .launcher_demo import register_demo

            names = register_demo(self.base_url, self.demo_folders, self.admin_headers())
            log.info("demo.registered", adapters=names)
        log.info("loraplex.ready", url=self.base_url, dashboard=f"{self.base_url}/dashboard", workers=self.config.workers,
                 data_dir=str(self.data_dir))

    def start_on_free_ports(self) -> None:
        """start, after prepare. A service that finds the port chosen for it taken (another stack choosing
        ports at the same moment) exits with EXIT_ADDRESS_IN_USE: the children started so far stop and the
        stack is prepared and started again on fresh ports. The gateway's port is the user's: final."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self.start()
                return
            except ChildFailed as e:
                taken = (e.status == EXIT_ADDRESS_IN_USE and e.child != "gateway"
                         or e.child == "redis" and redis_port_taken(self.data_dir / "redis", self.redis_log_start))
                if not taken or self.stop_requested or attempt == PORT_ATTEMPTS:
                    raise
                log.warning("launcher.port_taken", child=e.child, attempt=attempt, retrying=True)
                stop_children(list(reversed(self.children)), 15.0)
                self.children = []
                self.prepare()

    def wait_stack_ready(self) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while True:
            try:
                if http_ok(f"{self.base_url}/ready"):
                    return
            except Exception:
                pass
            if self.stop_requested:
                raise ChildFailed("startup cancelled while waiting for /ready")
            if time.monotonic() > deadline:
                raise ChildFailed(f"{self.base_url}/ready did not turn ready within {self.config.ready_timeout_s:g}s")
            for child in self.children:
                if not child.running():
                    raise ChildFailed(f"{child.name} exited with status {child.proc.returncode} during startup",
                                      child.proc.returncode, child.name)
            time.sleep(0.1)

    def admin_headers(self) -> dict[str, str]:
        if not self.config.api_keys_file:
            return {}
        keys = json.loads(Path(self.config.api_keys_file).read_text()).get("admin_keys") or []
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    # ---- 3) supervise ----------------------------------------------------------------------------
    def supervise(self) -> int:
        while not self.stop_requested:
            for child in self.children:
                if self.stop_requested:
                    break
                self.check(child)
            time.sleep(SUPERVISE_PERIOD_S)
        return 0

    def check(self, child: Child) -> None:
        if child.running():
            if not child.is_ready:
                if child.probe():
                    log.info("child.ready", child=child.name, pid=child.pid, restarted=True)
                elif time.monotonic() - child.started_at > self.config.ready_timeout_s:
                    log.error("child.not_ready", child=child.name, pid=child.pid)
                    child.signal(signal.SIGKILL)
                    child.wait(5.0)
            elif child.alive_check is not None and not child.alive_check(child):
                log.error("child.hung", child=child.name, pid=child.pid,
                          timeout_s=self.config.heartbeat_timeout_s)
                child.signal(signal.SIGKILL)
                child.wait(5.0)
            if child.running():
                return
        code = child.proc.returncode if child.proc is not None else None
        child.reap()
        now = time.monotonic()
        child.deaths = [t for t in child.deaths if now - t < CRASH_WINDOW_S] + [now]
        if len(child.deaths) > MAX_DEATHS:
            log.error("child.crash_loop", child=child.name, deaths=len(child.deaths), window_s=CRASH_WINDOW_S)
            self.exit_code = 1
            self.stop_requested = True
            return
        log.warning("child.died", child=child.name, pid=child.pid, status=code, restarting=True)
        child.start()

    # ---- 4) stop ---------------------------------------------------------------------------------
    def request_stop(self, signum, _frame) -> None:
        """The SIGTERM/SIGINT handler: flags and signals to children only, nothing that logs. A handler runs
        between two bytecodes of the main thread, possibly inside a log write holding the log's
        (non-reentrant) lock, where a log call would wait forever: two signals close together (a second
        Ctrl-C, or `timeout` forwarding one) hung the launcher that way. `stop` logs what was asked."""
        if self.stop_requested:
            self.force_stop = True
            for child in self.children:
                child.signal(signal.SIGKILL)
            return
        self.stop_signal = signum
        self.stop_requested = True

    def stop(self) -> None:
        if self.stop_signal is not None:
            log.info("launcher.stopping", signal=signal.Signals(self.stop_signal).name)
        by_name = {c.name: c for c in self.children}
        front = [c for c in (by_name.get("gateway"), by_name.get("scheduler")) if c is not None]
        # Drain: both stop taking requests (503) and let in-flight ones finish, the gateway streaming them.
        for child in front:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.drain_timeout_s + 10.0
        for child in front:
            if not child.wait(deadline - time.monotonic()):
                log.warning("launcher.drain_timeout", child=child.name)
        if self.force_stop:
            log.warning("launcher.stop_now")  # a second signal: every child was killed at once
        backends = [c for c in self.children if c.name not in ("gateway", "redis")]
        stop_children(front + backends, 15.0)
        stop_children([c for c in self.children if c.name == "redis"], 15.0)
        log.info("launcher.stopped")

    def run(self) -> int:
        self.exit_code = 0
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        try:
            self.prepare()
            self.start_on_free_ports()
            self.supervise()
        except ChildFailed as e:
            log.error("launcher.startup_failed", error=str(e))
            if self.stop_requested and "cancelled" in str(e):
                self.exit_code = 0
            else:
                # A taken HTTP port is passed on, so that whoever chose it can choose another.
                self.exit_code = EXIT_ADDRESS_IN_USE if e.status == EXIT_ADDRESS_IN_USE else 1
        finally:
            self.stop()
        return self.exit_code


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging(json=config.log_json)
    os.environ["LORAPLEX_LOG_JSON"] = "1" if config.log_json else "0"  # inherited by every child
    # Readiness probes poll over HTTP; one log line per probe would bury the services' own logs.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return Launcher(config).run()
    except RuntimeError as e:  # e.g. no redis-server available
        log.error("launcher.failed", error=str(e))
        return 1
