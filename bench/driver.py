"""A whole sweep on one GPU host, run in pieces that each end before a wall-time budget, resumable.

A sweep spec (YAML, bench/sweeps/*.yaml) names a setting, the systems, numbers of adapters, request rates,
cvs, alphas and admission policies, and the duration and warm-up of each point; its points are the product.
Points that need the same server form a group (setting, system and policy; and n for the PEFT server, which
holds exactly its n adapters): a group's stack is started once, registers the largest n of its points, and
runs them all.

A piece (`run_piece`) takes the points still missing from the results file (docs/bench/<sweep>.jsonl, one
JSON line per point, appended as each point ends) in the sweep's order while they fit in its budget: a stack
is started only if its startup, one point and its stop fit in the time left by the estimates, and each
further point of a started stack only if it and the stop fit in what the clock says is left. Estimates are
the spec's, raised to the longest this host has taken so far (timings.json in the work dir), so a stack is
never started to measure nothing; later points go by the clock, so a piece that runs faster than estimated
measures more instead of leaving its budget unused. A fresh stack can first get `stack_warmup_s` of its
first point's traffic, not measured (adapters into the host cache, shapes the points will see). The first point after a
start always runs: a start slower than estimated must not leave every piece starting a stack and measuring
nothing. Adapter generation and registration stop at the budget too and continue in the next piece (the
stack's Redis keeps what was registered). Running the same command again resumes; a point already in the
results file is never run again (`--since` makes older lines count as not measured). Exit status of the
command: 0 when every point is in the file, 3 when more pieces are needed. Base-only points run on their
sweep's loraplex stack (`stack_system`).

The work dir (default data/bench, git-ignored) is shared by every sweep: models/ (config and tokenizer per
base), adapters/<setting>-s<seed>/ (one population per setting and seed), data/<setting>-s<seed>/ (the
stacks' data dir: registry and blobs of that population), logs/, records/<sweep>/ (per-request records of
each point), peft-views/ and timings.json.
"""
from __future__ import annotations

import dataclasses
import datetime
import fcntl
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import yaml

from bench import child_env, write_file_atomically
from bench.roofline import MAX_RUNNING
from bench.settings import Setting, get_setting
from bench.stack import NO_UNIFY_ADAPTERS, Stack, StackConfig, check_policy, check_system, registry_dir

MORE_PIECES = 3
DEFAULT_BUDGET_S = 540.0
# Seconds a stack takes to register one new adapter until this host has timed its own (2000 of S2's took 37-46 s
# on the GPU hosts): a fresh host's registry is empty, and a stack that starts without counting them may leave
# its first point too little time to finish.
REGISTRATION_S_PER_ADAPTER = 0.025
# The sweep fields a system may set for itself (SweepSpec.by_system).
BY_SYSTEM = ("n", "request_timeout_s", "point_tail_s")
ADAPTER_SYSTEMS = ("loraplex", "merge", "bmm", "no-unify", "peft")  # systems that serve the population


@dataclass
class SweepSpec:
    """One sweep (YAML keys are these field names; lists may be given as one value)."""

    name: str
    setting: str
    systems: list[str]
    n: list[int]
    rates: list[float]
    cvs: list[float] = field(default_factory=lambda: [1.0])
    alphas: list[float] = field(default_factory=lambda: [1.0])
    policies: list[str] = field(default_factory=lambda: ["early-abort"])
    # A system's own values where they differ from the sweep's (BY_SYSTEM), e.g. base-only and peft at one
    # n only, and peft's requests given up sooner (it serves ~1 req/s, so at the sweep's rate most wait).
    by_system: dict = field(default_factory=dict)
    duration_s: float = 120.0
    warmup_s: float = 20.0
    seed: int = 0
    prompt_range: list[int] = field(default_factory=lambda: [8, 512])
    output_range: list[int] = field(default_factory=lambda: [8, 512])
    request_timeout_s: float = 300.0
    # the stack
    device: str = ""  # "" = cuda when visible
    arena_gb: float = 0.0  # host-RAM adapter cache; 0 = the launcher's default
    num_slots: int = 0  # 0 = sized from GPU memory (CUDA) / 4096 (CPU)
    adapter_budget_gb: float = 16.0  # distinct adapter weight sets on disk (bench/adapters.py)
    no_unify_adapters: int = NO_UNIFY_ADAPTERS
    register_concurrency: int = 16
    set: list[str] = field(default_factory=list)  # further --set SERVICE.FLAG=VALUE for loraplex stacks
    ready_timeout_s: float = 900.0
    # piece planning (raised to what this host has measured)
    stack_warmup_s: float = 0.0  # traffic sent to a fresh stack before its first point, not measured
    startup_s: float = 60.0  # a stack's start, registration aside (an H200 starts Llama-2-7B shapes in ~45 s)
    point_tail_s: float = 30.0  # a point's time beyond its duration (the queue draining, summaries)
    stop_s: float = 30.0
    # The server's largest running batch, for the roofline; a `set` entry worker.max_running_requests=N sets it,
    # so the roofline always assumes the batch the stack was started with.
    max_running: int = MAX_RUNNING

    def __post_init__(self) -> None:
        for name in ("systems", "n", "rates", "cvs", "alphas", "policies", "set"):
            value = getattr(self, name)
            if not isinstance(value, list):
                setattr(self, name, [value])
        for entry in self.set:
            key, _, value = str(entry).partition("=")
            if key.strip() == "worker.max_running_requests":
                try:
                    self.max_running = int(value)
                except ValueError:
                    raise ValueError(f"sweep {self.name!r}: set: worker.max_running_requests must be an integer, "
                                     f"got {value!r}") from None
        get_setting(self.setting)
        for system in self.systems:
            check_system(system)
        if not isinstance(self.by_system, dict):
            raise ValueError(f"sweep {self.name!r}: by_system maps a system to {{n: [...], request_timeout_s: T}}")
        for system, own in self.by_system.items():
            if system not in self.systems:
                raise ValueError(f"sweep {self.name!r}: by_system names {system!r}, which is not in systems")
            unknown = sorted(set(own) - set(BY_SYSTEM)) if isinstance(own, dict) else ["(not a mapping)"]
            if unknown:
                raise ValueError(f"sweep {self.name!r}: by_system.{system}: unknown field(s) {', '.join(unknown)}; "
                                 f"known: {', '.join(BY_SYSTEM)}")
            if "n" in own and not isinstance(own["n"], list):
                own["n"] = [own["n"]]
            if "request_timeout_s" in own and not own["request_timeout_s"] > 0:
                raise ValueError(f"sweep {self.name!r}: by_system.{system}.request_timeout_s must be > 0")
        for policy in self.policies:
            check_policy(policy)
        if not self.systems or not self.n or not self.rates:
            raise ValueError(f"sweep {self.name!r}: systems, n and rates must each name at least one value")
        for ns in [self.n, *(own["n"] for own in self.by_system.values() if "n" in own)]:
            if not ns or any(int(n) != n or n < 0 for n in ns):
                raise ValueError(f"sweep {self.name!r}: n must be integers >= 0, got {ns}")
        if any(r <= 0 for r in self.rates) or any(c <= 0 for c in self.cvs):
            raise ValueError(f"sweep {self.name!r}: rates and cvs must be > 0")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"sweep {self.name!r}: warmup_s must be in [0, duration_s)")

    @classmethod
    def from_dict(cls, values: dict, default_name: str = "") -> "SweepSpec":
        if not isinstance(values, dict):
            raise ValueError("a sweep spec is a YAML mapping of field: value")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sweep field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        values = dict(values)
        values.setdefault("name", default_name)
        missing = [k for k in ("name", "setting", "systems", "n", "rates") if not values.get(k) and values.get(k) != 0]
        if missing:
            raise ValueError(f"sweep spec lacks {', '.join(missing)}")
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path) -> "SweepSpec":
        path = Path(path)
        return cls.from_dict(yaml.safe_load(path.read_text()) or {}, default_name=path.stem)

    def own(self, system: str, name: str):
        """`name`'s value for `system`'s points: its by_system value, else the sweep's."""
        return self.by_system.get(system, {}).get(name, getattr(self, name))

    @property
    def setting_obj(self) -> Setting:
        return get_setting(self.setting)


def point_key(p) -> str:
    """The identity of a point in a results file (a line with this key is this point, measured)."""
    return (f"{p.setting}/{p.system}/n={p.n_adapters}/alpha={p.alpha:g}/R={p.req_rate:g}/cv={p.cv:g}/{p.policy}"
            f"/d={p.duration_s:g}/seed={p.seed}")


def expand(spec: SweepSpec) -> list:
    """Every point of the sweep, n by n in the spec's order (so the first n's comparisons between systems run
    first), then systems, policies, alphas, rates and cvs."""
    from bench.point import PointSpec

    points = []
    for n in dict.fromkeys(int(n) for s in spec.systems for n in spec.own(s, "n")):
        systems = [s for s in spec.systems if n in [int(x) for x in spec.own(s, "n")]]
        for system, policy, alpha, rate, cv in itertools.product(systems, spec.policies, spec.alphas, spec.rates,
                                                                 spec.cvs):
            points.append(PointSpec(setting=spec.setting, system=system, n_adapters=n, alpha=float(alpha),
                                    req_rate=float(rate), cv=float(cv), policy=policy,
                                    duration_s=float(spec.duration_s), warmup_s=float(spec.warmup_s),
                                    seed=int(spec.seed), prompt_range=tuple(spec.prompt_range),
                                    output_range=tuple(spec.output_range)))
    return points


def stack_system(system: str) -> str:
    """The system whose stack serves `system`'s points: base-only is the loraplex stack with every request
    sent to the base model, so it shares that stack (and its comparison with LoRA runs on the same server)."""
    return "loraplex" if system == "base-only" else system


def stack_key(p) -> tuple:
    """Points with equal keys run on one stack. A loraplex-family stack registers the largest n of its points
    and serves each point's first n adapters (an adapter registered but never asked for costs nothing while
    serving); the PEFT server holds exactly n adapters, so n is part of its key."""
    return (p.setting, stack_system(p.system), p.n_adapters if p.system == "peft" else None, p.policy)


def groups(points: list) -> list[tuple[tuple, list]]:
    out: dict[tuple, list] = {}
    for p in points:
        out.setdefault(stack_key(p), []).append(p)
    return list(out.items())


def done_keys(results: Path, since: str = "") -> set[str]:
    """Keys of the points in a results file; with `since` (an ISO time, UTC), only of those started at or
    after it, so a sweep measures again what an older version of the server measured (its lines stay in the
    file as history; readers take a point's latest line)."""
    if not results.is_file():
        return set()
    cutoff = _utc(since) if since else None
    keys = set()
    for text in results.read_text().splitlines():
        if text.strip():
            try:
                line = json.loads(text)
                if cutoff is None or _utc(line["started_at"]) >= cutoff:
                    keys.add(line["key"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a line cut short by a kill: its point runs again
    return keys


def _utc(text: str) -> datetime.datetime:
    t = datetime.datetime.fromisoformat(text)
    return t.replace(tzinfo=datetime.timezone.utc) if t.tzinfo is None else t


def append_line(results: Path, line: dict) -> None:
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # drivers on other GPUs of the host append to the same file
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def selected(points: list, only: tuple[str, ...] = ()) -> list:
    """The points whose key contains one of `only` (all of them when it is empty): `--only /n=5/` runs one n of
    a sweep, so a short GPU booking measures again the points a change concerns, not the whole sweep."""
    return [p for p in points if not only or any(text in point_key(p) for text in only)]


def check_only(points: list, only: tuple[str, ...]) -> None:
    """Raise naming each `--only` text that no point of the sweep matches: a typo would otherwise run nothing
    and report the sweep complete, and a GPU booking would end with none of the points it was for."""
    keys = [point_key(p) for p in points]
    unmatched = [text for text in only if not any(text in key for key in keys)]
    if unmatched:
        example = f" (keys look like {keys[0]})" if keys else ""
        raise ValueError(f"--only {', '.join(repr(t) for t in unmatched)} matches no point of the sweep{example}")


def shard_of(text: str) -> tuple[int, int]:
    """`I/N` -> (I, N): this driver takes every N-th point still to run, starting at the I-th."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"shard {text!r} is not I/N (e.g. 0/4)") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"shard {text!r}: need 0 <= I < N")
    return i, n


def adapters_in(group: list) -> int:
    """The adapters a stack serving these points registers: the largest n among them (base-only uses none)."""
    return max((p.n_adapters for p in group if p.system != "base-only"), default=0)


class Timings:
    """What this host has taken so far (stack starts, point tails), by setting/system; raises the estimates."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, kind: str, key: str, default: float) -> float:
        return max(default, float(self.data.get(kind, {}).get(key, 0.0)))

    def note(self, kind: str, key: str, seconds: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Drivers on other GPUs of the host note theirs too: merge under a lock, write through a temp file of
        # this process's own, so no update is lost and no reader sees half a file.
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.path.is_file():
                for k, table in json.loads(self.path.read_text()).items():
                    mine = self.data.setdefault(k, {})
                    for name, value in table.items():
                        mine[name] = max(float(mine.get(name, 0.0)), float(value))
            table = self.data.setdefault(kind, {})
            table[key] = max(float(table.get(key, 0.0)), seconds)
            write_file_atomically(self.path, json.dumps(self.data, indent=1))


def measure_ceilings_apart(device: str) -> dict:
    """The ceilings, measured in a child process so this one never holds a CUDA context (the worker sizes
    its pool from the GPU memory left free)."""
    code = ("import json, sys, torch; from bench.roofline import measure_ceilings\n"
            "d = sys.argv[1] or ('cuda' if torch.cuda.is_available() else 'cpu')\n"
            "print(json.dumps(measure_ceilings(d).as_dict()))")
    out = subprocess.run([sys.executable, "-c", code, device], capture_output=True, text=True, env=child_env(),
                         timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"measuring the ceilings failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def note(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


@dataclass
class PieceResult:
    ran: list[str]  # keys of the points this piece measured
    remaining: int  # points still missing from the results file
    total: int
    stopped_for: str = ""  # why the piece ended before the sweep did

    @property
    def complete(self) -> bool:
        return self.remaining == 0


class Driver:
    def __init__(self, spec: SweepSpec, work_dir: str | Path, results: str | Path, budget_s: float = DEFAULT_BUDGET_S,
                 command: str = "", progress: bool = True, roofline: bool = True, since: str = "",
                 lane: str = "", shard: tuple[int, int] = (0, 1), only: tuple[str, ...] = (), run: str = ""):
        self.spec = spec
        # One `loraplex bench sweep` command (its lanes share their parent's): a ratio target that asks for
        # two points "in the same run" checks that both lines carry the same one (bench/targets.py).
        self.run = run or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.only = tuple(only)  # key fragments: run only the points matching one of them
        self.lane = lane  # this driver's GPU among several on the host ("" = the only one)
        self.shard = shard
        self.since = since  # points measured before this (ISO, UTC) count as not measured
        self.setting = spec.setting_obj
        self.work_dir = Path(work_dir).resolve()
        self.results = Path(results)
        self.budget_s = budget_s
        self.command = command or shlex.join(sys.argv)
        self.progress = progress
        self.roofline = roofline
        self.timings = Timings(self.work_dir / "timings.json")
        self.started = time.monotonic()

    # ---- time --------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def timing_key(self, system: str) -> str:
        return f"{self.spec.setting}/{system}"

    def point_estimate(self, p) -> float:
        return p.duration_s + self.timings.get("point_tail", self.timing_key(p.system),
                                               self.spec.own(p.system, "point_tail_s"))

    def startup_estimate(self, system: str, n: int = 0) -> float:
        """A stack's start, the registration of those of its n adapters its registry lacks, and its warm-up."""
        warmup = self.spec.stack_warmup_s + self.spec.point_tail_s if self.spec.stack_warmup_s else 0.0
        return (self.timings.get("startup", self.timing_key(system), self.spec.startup_s)
                + self.registration_estimate(system, n) + warmup)

    def registry(self) -> Path:
        """The data folder of the stacks serving this sweep's adapter population."""
        return registry_dir(self.work_dir, self.population_dir().name, self.lane)

    def registration_estimate(self, system: str, n: int) -> float:
        if system not in ADAPTER_SYSTEMS or n <= 0:
            return 0.0
        registry = self.registry()
        # Registered by an earlier stack of this host (noted once complete), while its data folder stands.
        known = self.timings.get("registered", str(registry), 0.0) if registry.is_dir() else 0.0
        per_adapter = self.timings.get("registration_s_per_adapter", self.spec.setting, REGISTRATION_S_PER_ADAPTER)
        return max(0.0, n - known) * per_adapter

    def note_registration(self, n: int, reg) -> None:
        if not reg.complete:
            return
        self.timings.note("registered", str(self.registry()), float(n))
        if reg.created >= 50:  # enough to time; a handful is mostly the call's fixed cost
            self.timings.note("registration_s_per_adapter", self.spec.setting, reg.seconds / reg.created)

    # ---- adapters ----------------------------------------------------------------------------------
    def population_dir(self) -> Path:
        return self.work_dir / "adapters" / f"{self.setting.name}-s{self.spec.seed}"

    def population(self, n: int):
        from bench.adapters import generate_adapters

        return generate_adapters(self.setting, self.population_dir(), n, seed=self.spec.seed,
                                 byte_budget=int(self.spec.adapter_budget_gb * 1e9), progress=self.progress,
                                 deadline=self.started + self.budget_s - self.spec.stop_s)

    def stack_config(self, system: str, n: int, policy: str, population) -> StackConfig:
        s = self.spec
        return StackConfig(setting=self.setting, system=system, work_dir=self.work_dir, population=population,
                           n_adapters=n, policy=policy,
                           arena_bytes=int(s.arena_gb * 2**30), device=s.device, num_slots=s.num_slots,
                           no_unify_adapters=s.no_unify_adapters, extra_set=tuple(s.set),
                           ready_timeout_s=s.ready_timeout_s, register_concurrency=s.register_concurrency,
                           progress=self.progress, lane=self.lane)

    # ---- one piece ---------------------------------------------------------------------------------
    def run_piece(self) -> PieceResult:
        points = selected(expand(self.spec), self.only)
        done = done_keys(self.results, self.since)
        pending = [(key, [p for p in group if point_key(p) not in done]) for key, group in groups(points)]
        pending = self.my_share([(key, group) for key, group in pending if group])
        remaining = sum(len(g) for _, g in pending)
        result = PieceResult(ran=[], remaining=remaining, total=len(points))
        n_done = sum(point_key(p) in done for p in points)
        i, n = self.shard
        share = f", {remaining} of them in this lane's share ({i}/{n})" if n > 1 else ""
        note(f"sweep {self.spec.name}: {n_done} of {len(points)} points done, {len(points) - n_done} to run{share}, "
             f"budget {self.budget_s:g} s")
        if not pending:
            return result
        ceilings = None
        for i, ((_, system, _, policy), group) in enumerate(pending):
            why = self.stack_fits(system, group)
            if why:
                if i == 0 and self.elapsed() < 0.1 * self.budget_s:  # a fresh piece cannot fit it: none ever will
                    raise ValueError(f"sweep {self.spec.name}: {why}, in a fresh piece of "
                                     f"{self.budget_s:g} s; raise --budget-s or shorten the points")
                result.stopped_for = why
                break
            if i == 0 and self.roofline:  # measured once per piece, before its first stack
                ceilings = measure_ceilings_apart(self.spec.device)
                held = ceilings.get("matmul_held_tflops")
                note(f"ceilings on {ceilings['name']}: copy {ceilings['hbm_gbs']:.0f} GB/s, matmul "
                     f"{ceilings['matmul_tflops']:.1f} TFLOP/s"
                     + (f" ({held:.1f} held back to back)" if held else "")
                     + f", host-to-device {ceilings['h2d_gbs']:.1f} GB/s")
            n = adapters_in(group)
            population = None
            if system in ADAPTER_SYSTEMS and n > 0:
                population = self.population(n)
                if not population.complete:
                    result.stopped_for = "adapter generation reached the budget; it continues in the next piece"
                    break
            stopped = self.run_group(system, n, policy, population, group, ceilings, result)
            if stopped:
                result.stopped_for = stopped
                break
        result.remaining = remaining - len(result.ran)
        return result

    def my_share(self, pending: list[tuple[tuple, list]]) -> list[tuple[tuple, list]]:
        """Every N-th point still to run, in the sweep's order, for shard I of N: drivers started together on
        the host's GPUs read the same results file, so their shares are disjoint and cover the rest."""
        i, n = self.shard
        if n == 1:
            return pending
        order = itertools.count()
        mine = [(key, [p for p in group if next(order) % n == i]) for key, group in pending]
        return [(key, group) for key, group in mine if group]

    def stack_fits(self, system: str, group: list) -> str:
        """Why a stack of `system` and the group's first point would not fit in what is left of the budget, by
        the estimates (a start measured slower before counts; adapters its registry lacks), or "" when they do.
        Its points are taken one by one while the real time left holds them (run_group), so a piece whose start
        and points go faster than estimated measures more instead of leaving its budget unused."""
        need = self.startup_estimate(system, adapters_in(group)) + self.spec.stop_s + self.point_estimate(group[0])
        if need > self.left():
            return (f"a {system} stack and its first point need ~{need:.0f} s; "
                    f"~{self.left():.0f} s of the budget are left")
        return ""

    def run_group(self, system: str, n: int, policy: str, population, group: list, ceilings: dict | None,
                  result: PieceResult) -> str:
        """Start the group's stack and run its points while they fit; the reason it stopped early, or ""."""
        from bench.point import PointOverran
        from bench.stack import stack_info

        why = self.stack_fits(system, group)  # again: the ceilings and the adapters' generation took time too
        if why:
            return why
        config = self.stack_config(system, n, policy, population)
        registration_deadline = self.started + self.budget_s - self.point_estimate(group[0]) - self.spec.stop_s
        note(f"starting {config.label} ({self.left():.0f} s of the budget left)")
        stack = Stack(config)
        stack.start(registration_deadline=registration_deadline)
        try:
            self.timings.note("startup", self.timing_key(system), stack.startup_s)
            if stack.registration is not None:
                reg = stack.registration
                note(f"  registered {reg.created} new adapters in {reg.seconds:.1f} s ({reg.rate:.1f}/s), "
                     f"{reg.already} already there")
                self.note_registration(n, reg)
                if not reg.complete:
                    return "adapter registration reached the budget; it continues in the next piece"
            info = stack_info(stack)
            pool_slots = pool_total_slots(stack.url)
            if self.spec.stack_warmup_s:
                self.warm_up(stack, group[0])
            for i, p in enumerate(group):
                # The first point too: a start, registration or warm-up slower than estimated may have taken
                # its time, and a point cut off at the budget leaves no line.
                if self.point_estimate(p) + self.spec.stop_s > self.left():
                    return f"the next point needs ~{self.point_estimate(p):.0f} s, {self.left():.0f} s are left"
                try:
                    line = self.run_one(stack, p, ceilings, pool_slots, info, population)
                except PointOverran as e:
                    tail = self.timings.get("point_tail", self.timing_key(system), 0.0)
                    return (f"{point_key(p)} ran past the budget ({e}) and has no line; its tail is now "
                            f"estimated at >= {tail:.0f} s (a slow system may need a lower request_timeout_s)")
                result.ran.append(line["key"])
                note(f"[{len(result.ran)}/{result.remaining}] {summary(line)} ({self.elapsed():.0f}/{self.budget_s:g} s)")
        finally:
            stack.stop()
            if stack.left_behind:
                note(f"  warning: {len(stack.left_behind)} processes outlived the stack and were killed")
        return ""

    def warm_up(self, stack: Stack, first) -> None:
        """The first point's traffic, shorter and with another seed, thrown away: kernels compiled and graphs
        captured for the shapes the points will see, adapters in the host cache, before anything is measured."""
        from bench.point import PointOverran, run_point

        spec = dataclasses.replace(first, duration_s=self.spec.stack_warmup_s, warmup_s=0.0, seed=first.seed + 1)
        note(f"  warm-up: {spec.duration_s:g} s of traffic at {spec.req_rate:g} req/s, not measured")
        model_for = point_model_for(first, stack.base_model, stack.model_for)
        # Bounded as the plan counts it (startup_estimate): a slow system's warm-up backlog is given up.
        bound = spec.duration_s + self.spec.own(first.system, "point_tail_s")
        try:
            run_point(stack.url, spec, model_for, self.setting.vocab_size, command=self.command,
                      request_timeout_s=self.spec.own(first.system, "request_timeout_s"), progress=self.progress,
                      max_wall_s=bound)
        except PointOverran:
            note(f"  warm-up: requests still in flight after {bound:g} s were given up")

    def run_one(self, stack: Stack, p, ceilings: dict | None, pool_slots: int, info: dict, population) -> dict:
        from bench.point import PointOverran, run_point

        t0 = time.monotonic()
        records = self.work_dir / "records" / self.spec.name / (point_key(p).replace("/", "_") + ".jsonl")
        cpu = ServiceCpu(stack)
        model_for = point_model_for(p, stack.base_model, stack.model_for)
        try:
            line = run_point(stack.url, p, model_for, self.setting.vocab_size, command=self.command,
                             request_timeout_s=self.spec.own(p.system, "request_timeout_s"), progress=self.progress,
                             records_path=records, max_wall_s=max(1.0, self.left() - self.spec.stop_s))
        except PointOverran as e:
            # Its tail so far is a lower bound: the plans of later pieces reserve at least that much.
            self.timings.note("point_tail", self.timing_key(p.system), max(0.0, e.wall_s - p.duration_s))
            raise
        wall = time.monotonic() - t0
        line.update(cpu.report(wall))
        self.timings.note("point_tail", self.timing_key(p.system), max(0.0, wall - p.duration_s))
        line.update(key=point_key(p), sweep=self.spec.name, run=self.run, **info)
        if self.lane:
            line["lane"] = self.lane
        if ceilings is not None:
            line.update(self.roofline_fields(p, line, ceilings, pool_slots, population))
        append_line(self.results, line)
        return line

    def roofline_fields(self, p, line: dict, ceilings: dict, pool_slots: int, population) -> dict:
        from bench.roofline import Ceilings, attainable_rps, held, roofline_rps, server_batch
        from bench.step_floor import with_floors

        c = Ceilings(**ceilings)
        trace = p.trace()
        if p.system == "base-only" or not p.n_adapters:
            ranks = [0] * max(1, p.n_adapters)
        else:
            ranks = population.ranks[:p.n_adapters] if population is not None else None
        batch = server_batch(self.setting, trace, self.spec.max_running, pool_slots, ranks)
        dtype_bytes = 2 if c.device.startswith("cuda") else 4  # bf16 on GPUs, fp32 on the CPU backend
        rps = roofline_rps(self.setting, trace, c, batch, ranks, dtype_bytes)
        throughput = line.get("throughput_rps")
        fields = {}
        at_held = held(c)
        if at_held is not None:
            # The roofline at the matmul rate the GPU holds under its power limit: beside the one judged by.
            rps_held = roofline_rps(self.setting, trace, at_held, batch, ranks, dtype_bytes)
            fields = {"roofline_rps_held": rps_held,
                      "roofline_fraction_held": throughput / rps_held if throughput is not None else None}
        return {**fields, "roofline_rps": rps, "roofline_batch": batch, "ceilings": ceilings,
                "roofline_fraction": throughput / rps if throughput is not None else None,
                # The most of the roofline any server reaches here: each operation at its binding ceiling.
                "attainable_rps": attainable_rps(self.setting, trace, c, batch, ranks, dtype_bytes),
                # Each kind of step against what its own work allows, from the worker's counters.
                "worker_steps": with_floors(line.get("worker_steps"), self.setting, c, dtype_bytes),
                "worker_steps_window": with_floors(line.get("worker_steps_window"), self.setting, c, dtype_bytes)}


def point_model_for(p, base_model: str, model_for: Callable) -> Callable:
    """The `model` of each of point `p`'s requests: `model_for`'s choice (its adapter, or the base model),
    or the base model for every request of a base-only point."""
    return (lambda request: base_model) if p.system == "base-only" else model_for


class ServiceCpu:
    """CPU time each of a stack's processes spends during a point (the gateway, scheduler, store, redis and
    each worker; the PEFT server is one process): a single-threaded service near one core is where the
    serving path saturates before the GPU does."""

    def __init__(self, stack: Stack):
        from shared.probes import cpu_seconds, service_pids

        pid = stack.proc.pid if stack.proc is not None else None
        self.pids = (service_pids(pid) or {stack.config.system: pid}) if pid is not None else {}
        self.start = {name: cpu_seconds(p) for name, p in self.pids.items()}

    def report(self, wall_s: float) -> dict:
        from shared.probes import cpu_seconds

        used = {}
        for name, pid in self.pids.items():
            now, then = cpu_seconds(pid), self.start[name]
            if now is not None and then is not None:
                used[name] = round(now - then, 3)
        return {"service_cpu_s": used,
                "service_cpu_cores": {name: round(s / wall_s, 3) for name, s in used.items()} if wall_s > 0 else {}}


def pool_total_slots(url: str) -> int:
    """The worker's pool size from /metrics (0 when the server has none, e.g. the PEFT baseline)."""
    import httpx

    from shared.probes import metric

    try:
        text = httpx.get(url + "/metrics", timeout=10.0).text
        return int(metric(text, "loraplex_pool_slots", worker="worker-0", kind="total") or 0)
    except (httpx.HTTPError, ValueError):  # no server metrics, or not Prometheus text (as ServerSampler)
        return 0


def summary(line: dict) -> str:
    def num(key, fmt):
        v = line.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    return (f"{line['setting']} {line['system']} n={line['n_adapters']} R={line['req_rate']:g} cv={line['cv']:g} "
            f"{line['policy']}: {num('throughput_rps', '.2f')} req/s, TTFT p50 {num('ttft_p50_s', '.2f')} s, "
            f"SLO {num('slo_attainment', '.2f')}, roofline {num('roofline_fraction', '.2f')}"
            + (f" ({num('roofline_fraction_held', '.2f')} at the held matmul rate)"
               if line.get("roofline_fraction_held") is not None else ""))


def run_sweep(spec_path: str | Path, work_dir: str | Path | None = None, out_dir: str | Path = "docs/bench",
              budget_s: float = DEFAULT_BUDGET_S, command: str = "", progress: bool = True) -> PieceResult:
    spec = SweepSpec.load(spec_path)
    work_dir = Path(work_dir) if work_dir else Path("data") / "bench"
    results = Path(out_dir) / f"{spec.name}.jsonl"
    return Driver(spec, work_dir, results, budget_s, command, progress).run_piece()
