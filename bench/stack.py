"""One server under test, started as a subprocess for a system and stopped with everything it started.

Systems (BENCHMARKS.md "Baselines"), each the same trace against the same GPU:
- loraplex   `loraplex up` as shipped (unified pool, Triton kernels)
- base-only  a loraplex stack, every request sent to the base model (the upper bound for LoRA's cost;
             bench.driver runs its points on the loraplex stack of the same sweep)
- bmm        `--set worker.lora_mode=bmm`: adapters copied to contiguous buffers padded to the max rank
- merge      `--set worker.lora_mode=merge`: one adapter per batch, merged into the weights and undone
- no-unify   `--set worker.adapter_pool_slots=N`: the same pool split into fixed adapter and KV parts
- peft       `python -m bench.baselines.peft_server` (transformers + peft, requests grouped by adapter)
Admission policies are scheduler flags (POLICIES). Every loraplex-family stack of a setting shares one data
dir (its Redis AOF keeps the registry, its blob folder the adapters), so adapters registered by an earlier
stack are still registered: a registration that a piece of a sweep had to stop continues in the next one.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import REPO, child_env
from bench.adapters import DEFAULT_CONCURRENCY, Population, Registration, register
from bench.settings import Setting
from shared.config import EngineConfig
from services.launcher_children import die_with_parent
from shared.ports import EXIT_ADDRESS_IN_USE, free_port
from shared.probes import alive, descendants

SYSTEMS = ("loraplex", "base-only", "peft", "merge", "bmm", "no-unify")
LORA_MODES = {"bmm": "bmm", "merge": "merge"}
# Admission policies of the cv sweep: S-LoRA's early abort with its FCFS/LCFS switch (the server's
# default), and plain FCFS and LCFS with early abort off.
POLICIES: dict[str, tuple[str, ...]] = {
    "early-abort": ("scheduler.first_token_slo_s=6", "scheduler.queue_order=auto"),
    "fcfs": ("scheduler.first_token_slo_s=0", "scheduler.queue_order=fcfs"),
    "lcfs": ("scheduler.first_token_slo_s=0", "scheduler.queue_order=lcfs"),
    # Early abort with newest first only once the queue cannot drain in time oldest first.
    "early-abort-deadline": ("scheduler.first_token_slo_s=6", "scheduler.queue_order=deadline"),
}
# The no-unify adapter part holds a running batch's worth of adapters of the setting's largest rank (every
# request on its own adapter), since a fixed partition must fit its worst case.
NO_UNIFY_ADAPTERS = EngineConfig().max_running_requests
STOP_TIMEOUT_S = 60.0
PORT_ATTEMPTS = 3  # starts on fresh HTTP ports when the chosen one turns out to be taken


def check_system(system: str) -> str:
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")
    return system


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown admission policy {policy!r}; choose one of {', '.join(POLICIES)}")
    return policy


def adapter_slots(setting: Setting, rank: int) -> int:
    """Pool slots one adapter of this rank takes (the pool's row layout, services/gpu_worker/adapter_layout)."""
    from services.gpu_worker.adapter_layout import layout_offsets
    from shared.model_config import MODULES

    cfg = setting.model_config
    ranks = tuple(rank if m in setting.targets else 0 for m in MODULES)
    return layout_offsets(ranks, cfg, cfg.kv_dim)[2]


def no_unify_slots(setting: Setting, adapters: int = NO_UNIFY_ADAPTERS, num_slots: int = 0) -> int:
    """Slots reserved for adapters under no-unify: `adapters` of the largest rank; at most half a known pool."""
    slots = adapters * adapter_slots(setting, max(setting.ranks))
    return min(slots, num_slots // 2) if num_slots else slots


def registry_dir(work_dir: Path, population: str, lane: str = "") -> Path:
    """A stack's data folder (its Redis registry among it), one per adapter population and lane."""
    return work_dir / "data" / (f"{population}-{lane}" if lane else population)


@dataclass
class StackConfig:
    setting: Setting
    system: str
    work_dir: Path  # models/, data/<setting>/, logs/, peft-views/ live here
    population: Population | None = None  # the adapters; their folder is the server's --allowed-root
    n_adapters: int = 0  # the first n names of the population are registered and used
    policy: str = "early-abort"
    arena_bytes: int = 0  # host-RAM adapter cache; 0 = the launcher's default
    device: str = ""  # "" = cuda when visible
    num_slots: int = 0  # 0 = the launcher's default (sized from GPU memory on CUDA)
    no_unify_adapters: int = NO_UNIFY_ADAPTERS
    extra_set: tuple[str, ...] = ()  # further `--set SERVICE.FLAG=VALUE` for the loraplex stack
    extra_args: tuple[str, ...] = ()  # further launcher (or peft server) arguments
    ready_timeout_s: float = 900.0
    register_concurrency: int = DEFAULT_CONCURRENCY
    progress: bool = True
    env: dict[str, str] = field(default_factory=dict)
    # Several drivers on one host, one GPU each: each lane keeps its own registry and blobs (two Redis
    # servers must never share an append-only file) and its own PEFT view.
    lane: str = ""

    def __post_init__(self) -> None:
        check_system(self.system)
        if self.system == "base-only":
            raise ValueError("base-only runs on a loraplex stack, its requests all sent to the base model "
                             "(bench.driver.stack_system, point_model_for)")
        check_policy(self.policy)
        self.work_dir = Path(self.work_dir).resolve()
        if self.n_adapters and self.population is None:
            raise ValueError(f"{self.n_adapters} adapters asked for but no adapter population given")
        if self.population is not None and self.n_adapters > len(self.population.names):
            raise ValueError(f"{self.n_adapters} adapters asked for; the population has {len(self.population.names)}")

    @property
    def label(self) -> str:
        return f"{self.setting.name}/{self.system}/n={self.n_adapters}/{self.policy}"


def base_model(url: str, default: str) -> str:
    """The base model's name as the server at `url` lists it (the model folder's name for loraplex); `default`
    when it lists none."""
    import httpx

    models = httpx.get(url.rstrip("/") + "/v1/models", timeout=30.0).json()["data"]
    return next((m["id"] for m in models if not m.get("parent")), default)


class PortTaken(RuntimeError):
    pass


class Stack:
    """`with Stack(config) as stack:` a ready server at `stack.url`, its adapters registered; stopped on exit."""

    def __init__(self, config: StackConfig):
        self.config = config
        self.choose_port()
        self.proc: subprocess.Popen | None = None
        self.base_model = ""
        self.registration: Registration | None = None
        self.startup_s = 0.0
        self.left_behind: list[int] = []  # processes that outlived the stop (killed; tests check it stays empty)
        self.pids: set[int] = set()

    def choose_port(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        logs = self.config.work_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"{self.config.setting.name}-{self.config.system}-{self.port}.log"

    # ---- what runs ---------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        pop = self.config.population
        return pop.names[:self.config.n_adapters] if pop is not None else []

    def model_dir(self) -> Path:
        return self.config.setting.prepare_model(self.config.work_dir / "models")

    def data_dir(self) -> Path:
        """One per adapter population: its Redis registry holds exactly that population's names."""
        pop = self.config.population
        return registry_dir(self.config.work_dir, pop.root.name if pop is not None else self.config.setting.name,
                            self.config.lane)

    def flags(self) -> list[str]:
        """The `--set` flags of this system and policy."""
        c = self.config
        items = list(POLICIES[c.policy])
        # The setting's adapters adapt these modules: decode graphs captured before traffic run their LoRA
        # groups alone, so no graph is captured in a measured window.
        items.append(f"worker.cuda_graph_lora_targets={','.join(c.setting.targets)}")
        if c.system in LORA_MODES:
            items.append(f"worker.lora_mode={LORA_MODES[c.system]}")
        if c.system == "no-unify":
            items.append(f"worker.adapter_pool_slots={no_unify_slots(c.setting, c.no_unify_adapters, c.num_slots)}")
        items += c.extra_set
        return [arg for item in items for arg in ("--set", item)]

    def command(self) -> list[str]:
        c = self.config
        model = str(self.model_dir())
        if c.system == "peft":
            argv = [sys.executable, "-m", "bench.baselines.peft_server", "--dummy-weights", model,
                    "--adapters-dir", str(self.peft_view()), "--port", str(self.port)]
            if c.device:
                argv += ["--device", c.device]
            return argv + list(c.extra_args)
        argv = [sys.executable, "-m", "shared.cli", "up", "--dummy-weights", model, "--data-dir", str(self.data_dir()),
                "--port", str(self.port), "--drain-timeout-s", "5", "--ready-timeout-s", f"{c.ready_timeout_s:g}"]
        if c.population is not None:
            argv += ["--allowed-root", str(c.population.root.resolve())]
        if c.arena_bytes:
            argv += ["--arena-bytes", str(int(c.arena_bytes))]
        if c.device:
            argv += ["--device", c.device]
        if c.num_slots:
            argv += ["--num-slots", str(c.num_slots)]
        return argv + self.flags() + list(c.extra_args)

    def peft_view(self) -> Path:
        """A folder holding exactly the n adapters of this run (links to the population's folders): the
        PEFT server serves every folder under its --adapters-dir."""
        c = self.config
        view = c.work_dir / "peft-views" / "-".join(filter(None, [c.setting.name, str(c.n_adapters), c.lane]))
        view.mkdir(parents=True, exist_ok=True)
        wanted = set(self.names)
        for entry in view.iterdir():
            if entry.name not in wanted:
                entry.unlink()
        for name in self.names:
            link = view / name
            if not link.is_symlink():
                link.symlink_to((c.population.root / name).resolve(), target_is_directory=True)
        return view

    def model_for(self, request) -> str:
        """The `model` of a trace request: its adapter's name, or the base model."""
        if request.adapter is None:
            return self.base_model
        return self.names[request.adapter]

    # ---- start -------------------------------------------------------------------------------------
    def start(self, registration_deadline: float | None = None) -> "Stack":
        """Start and register; a server that found its HTTP port taken (chosen by another process at the same
        moment) is started again on another."""
        for _ in range(PORT_ATTEMPTS - 1):
            try:
                return self._start(registration_deadline)
            except PortTaken:
                sys.stderr.write(f"  {self.config.label}: port {self.port} was taken, starting on another\n")
                self.choose_port()
        return self._start(registration_deadline)

    def _start(self, registration_deadline: float | None) -> "Stack":
        c = self.config
        argv = self.command()
        env = child_env(PYTHONUNBUFFERED="1", **c.env)
        started = time.monotonic()
        self.log_file = open(self.log_path, "ab")
        self.log_file.write(("$ " + " ".join(argv) + "\n").encode())
        self.log_file.flush()
        # Its own session: a Ctrl-C at the driver's terminal reaches the driver, which then stops the stack.
        # And it dies with the driver, even one killed outright: a stack left behind would hold the GPU.
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=die_with_parent(os.getpid()))
        try:
            self._wait_ready(started)
            self.base_model = base_model(self.url, self.config.setting.model)
            self.startup_s = time.monotonic() - started
            if c.system != "peft" and self.names:
                self.registration = register(self.url, c.population.root, self.names,
                                             concurrency=c.register_concurrency, progress=c.progress,
                                             deadline=registration_deadline)
                if self.registration.failed:
                    first = next(iter(self.registration.failed.items()))
                    raise RuntimeError(f"{len(self.registration.failed)} adapters failed to register, e.g. {first[0]}: "
                                       f"{first[1]}")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, started: float) -> None:
        import httpx

        path = "/health" if self.config.system == "peft" else "/ready"
        deadline = started + self.config.ready_timeout_s
        next_note = started + 10.0
        while True:
            self.pids.update(descendants(self.proc.pid))
            try:
                if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                if self.proc.returncode == EXIT_ADDRESS_IN_USE:
                    raise PortTaken(f"{self.config.label}: port {self.port} taken")
                raise RuntimeError(f"{self.config.label}: server exited with {self.proc.returncode} before it was ready:\n"
                                   f"{self.log_tail()}")
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"{self.config.label}: {self.url}{path} not ready within "
                                   f"{self.config.ready_timeout_s:g} s:\n{self.log_tail()}")
            if self.config.progress and now >= next_note:
                next_note = now + 10.0
                sys.stderr.write(f"  {self.config.label}: waiting for {path} ({now - started:.0f} s)\n")
            time.sleep(0.25)

    def log_tail(self, chars: int = 4000) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    # ---- stop --------------------------------------------------------------------------------------
    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (the launcher drains and stops its children), SIGKILL after `timeout_s`; then every process
        the server ever started is made sure to be gone, and a store's arena left by a kill is unlinked."""
        if self.proc is None:
            return
        self.pids.update(descendants(self.proc.pid))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._kill([self.proc.pid, *descendants(self.proc.pid)])
                self.proc.wait(10)
        # Children die with the launcher (parent-death signal); give them a moment, then make sure.
        deadline = time.monotonic() + 15.0
        while (left := [p for p in self.pids if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            self.left_behind = left
            self._kill(left)
        for pid in self.pids:
            segment = Path(f"/dev/shm/loraplex-arena-{pid}")
            if segment.exists():
                segment.unlink(missing_ok=True)
        self.log_file.close()
        self.proc = None

    @staticmethod
    def _kill(pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "Stack":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def stack_info(stack: Stack) -> dict:
    """What a result line records about the server it measured."""
    c = stack.config
    info = {"stack_command": " ".join(stack.command()), "startup_s": round(stack.startup_s, 2),
            "arena_bytes": c.arena_bytes or None, "num_slots": c.num_slots or None}
    if stack.registration is not None:
        info["registration"] = stack.registration.as_dict()
    return info
