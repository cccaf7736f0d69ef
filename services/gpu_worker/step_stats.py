"""Where a worker's time goes, step by step: how many steps of each kind it ran, how long each took from the
start of its scheduling until its tokens reached the host, and how many tokens they carried.

Kinds: "graph", a decode step replayed from a CUDA graph; "decode", a decode step run eagerly (a batch no
graph covers, or any decode step on the CPU); "prefill", a step that carries prompt tokens, with or without
decode tokens beside them (an admission round). They are served as counters (WorkerStatus, then /metrics),
so the share of a window each kind took is the difference of two readings; `loraplex bench` records it for
every point. A step whose requests all stop mid-prompt samples nothing, so its time runs until its launch
returns and the wait for its kernels falls to the next step. With overlap_steps a step is launched before
the last one's tokens reach the host; it counts only from that moment (its own time, not the wait behind
the step before), so the kinds' seconds add up to the wall time whether steps overlap or not. `launch` is
the part of a step's seconds until its last kernel was launched: the host's scheduling, batch building and
kernel launches, as far as they ran after the step before had ended (launched ahead, only what the previous
step did not hide); a step whose launch takes nearly all of its time kept the GPU waiting on the host.
`ahead` counts the steps launched before the last one's tokens reached the host: an admission step not among
them was scheduled only once the step before had ended, its whole launch in the GPU's time.
`adapters` and `adapter_bytes` sum, over the steps, the distinct adapters whose rows a step's LoRA kernels read
and the bytes of those rows (adapter_layout.lora_read_bytes): over the step count, what a mean step of the kind
reads beside the base weights and KV, the part of a step that grows with the number of adapters served. They
are the rows, each counted once: a prefill step's kernels may read a long segment's rows once per chunk.
`decode_keys` sums the contexts its one-token rows read (their attention reads K/V: bytes), `prompt_pairs` the
keys its prompt chunks' tokens attend (their attention is causal matmuls: FLOPs), `sampled` the rows whose
logits it computed. With `tokens` and `adapter_bytes` they are what a kind's floor needs, each operation at
the ceiling that binds it (bench/step_floor.py). `captures` counts the decode graphs a step captured at first
use (under load, not at warm-up) and `capture_seconds` the host's time in them, kernel compiles included: time
inside the step's seconds that no floor accounts for. `builds` counts the Triton kernel variants built while a
step's kernels were issued (kernel_builds.py; in a capture too; warm-up's steps build most) and `build_seconds`
the host's time in them: after warm-up, a variant it did not reach, compiled under load while the GPU waits.
`gpu_seconds` sums, over the `gpu_steps` timed, the GPU's own time from a step's first kernel to its last
(CUDA timing events on the stream, waits for the host inside the step included). Summed over every kind, the
steps' seconds less their GPU seconds is the time the stream sat idle between steps; kind by kind it is not, since
a step launched ahead and issued slowly is charged that time in its own GPU interval and in the wall time of the
step before it (bench/targets.py, _idle_part).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

STEP_KINDS = ("graph", "decode", "prefill")
# Why a step was not launched ahead of the last one's tokens (Engine.held_back; overlap_steps).
HELD_BACK_REASONS = ("prompt", "batch", "round", "slots")


def _zeros(kind_type):
    return field(default_factory=lambda: {kind: kind_type(0) for kind in STEP_KINDS})


@dataclass
class StepStats:
    steps: dict[str, int] = _zeros(int)
    seconds: dict[str, float] = _zeros(float)
    tokens: dict[str, int] = _zeros(int)
    launch: dict[str, float] = _zeros(float)
    ahead: dict[str, int] = _zeros(int)  # steps launched before the last one's tokens reached the host
    adapters: dict[str, int] = _zeros(int)  # distinct adapters read, summed over steps
    adapter_bytes: dict[str, int] = _zeros(int)  # bytes of their rows, summed over steps
    decode_keys: dict[str, int] = _zeros(int)  # contexts read by one-token rows, summed
    prompt_pairs: dict[str, int] = _zeros(int)  # (query, key) pairs of prompt chunks, summed
    sampled: dict[str, int] = _zeros(int)  # rows whose logits the steps computed
    captures: dict[str, int] = _zeros(int)  # decode graphs captured at first use, inside the steps
    capture_seconds: dict[str, float] = _zeros(float)  # the host's seconds in those captures
    builds: dict[str, int] = _zeros(int)  # Triton kernel variants built while the steps were issued
    build_seconds: dict[str, float] = _zeros(float)  # the host's seconds in those builds
    gpu_seconds: dict[str, float] = _zeros(float)  # the GPU's time from each timed step's start to its end
    gpu_steps: dict[str, int] = _zeros(int)  # the steps timed on the GPU (CUDA, their tokens read back)
    last_end: float = float("-inf")  # when the last recorded step's tokens reached the host

    def record(self, kind: str, started: float, tokens: int, now: float | None = None,
               launched: float | None = None, ahead: bool = False, adapters: int = 0, adapter_bytes: int = 0,
               decode_keys: int = 0, prompt_pairs: int = 0, sampled: int = 0, captures: int = 0,
               capture_s: float = 0.0, builds: int = 0, build_s: float = 0.0, gpu_s: float | None = None) -> None:
        """One finished step of `kind`, begun at `started` and launched by `launched` (time.perf_counter);
        `ahead`: launched before the step before it had ended (overlap_steps); `adapters`: distinct adapters
        whose rows it read, `adapter_bytes` of rows; `decode_keys`, `prompt_pairs`, `sampled`, `captures`,
        `capture_s`, `builds`, `build_s`, `gpu_s` (None: not timed on the GPU): module doc."""
        if kind not in self.steps:
            raise ValueError(f"unknown step kind {kind!r}; kinds are {', '.join(STEP_KINDS)}")
        now = time.perf_counter() if now is None else now
        own = max(started, self.last_end)  # a step launched ahead waited behind the last one until then
        self.steps[kind] += 1
        self.seconds[kind] += max(0.0, now - own)
        self.tokens[kind] += tokens
        self.ahead[kind] += ahead
        self.adapters[kind] += adapters
        self.adapter_bytes[kind] += adapter_bytes
        self.decode_keys[kind] += decode_keys
        self.prompt_pairs[kind] += prompt_pairs
        self.sampled[kind] += sampled
        self.captures[kind] += captures
        self.capture_seconds[kind] += capture_s
        self.builds[kind] += builds
        self.build_seconds[kind] += build_s
        if gpu_s is not None:
            self.gpu_seconds[kind] += gpu_s
            self.gpu_steps[kind] += 1
        if launched is not None:
            self.launch[kind] += max(0.0, launched - own)
        self.last_end = max(self.last_end, now)


def step_gpu_seconds(flight) -> float | None:
    """The GPU's time for a finished step from its timing events (None without them, or while its last event
    has not passed: a step whose requests all stop mid-prompt is not waited for)."""
    if flight.gpu_events is None:
        return None
    start, end = flight.gpu_events
    return start.elapsed_time(end) / 1e3 if end.query() else None


def step_kind(replayed: bool, decode_only: bool) -> str:
    if replayed:
        return "graph"
    return "decode" if decode_only else "prefill"
