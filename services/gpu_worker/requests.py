"""Request-side types of the engine: what comes in, what goes out, and a request's running state."""
from __future__ import annotations

import time

from dataclasses import dataclass, field

import torch

from .resident_adapters import Resident
from .sampling import SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None  # None = base model only
    return_logits: bool = False  # keep each sampled position's logits (tests and debugging)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logits: list[torch.Tensor] | None = None


class Sequence:
    """A request in the engine. `tokens` is prompt + output; the first `num_computed` have K/V in the pool
    at `slots[:num_computed]`. Preemption drops the slots and resets num_computed: the request is
    recomputed from its tokens later, so its output does not change."""

    def __init__(self, req: EngineRequest, order: int):
        self.req = req
        self.order = order  # admission order; the newest running request is preempted first
        self.tokens = list(req.prompt_ids)
        self.prompt_len = len(req.prompt_ids)
        self.slots: list[int] = []
        # Slots taken from the pool for this request's next tokens and not yet given to any (kv_slot_run): its
        # context then lies in runs of consecutive slots. Freed with the rest.
        self.spare_slots: list[int] = []
        self.row: int | None = None  # page-table row while running
        self.num_computed = 0
        self.adapter: Resident | None = None
        self.generator = req.sampling.make_generator()
        self.queued_at = time.monotonic()  # when the engine got it; a preempted request keeps its place in time

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.tokens) - self.num_computed


@dataclass
class StepInFlight:
    """A launched step: its outputs so far (aborts from before it), and the requests that sample from its
    logits once the GPU is done."""

    outputs: list[RequestOutput]
    samplers: list[Sequence] = field(default_factory=list)
    logits: torch.Tensor | None = None
    greedy: object = None  # sampling.GreedyTokens of the logits
    scheduled: set = field(default_factory=set)  # every request whose slots the step writes
    replayed: bool = False  # a decode step replayed from a CUDA graph (else run eagerly)
    kind: str = ""  # step_stats.STEP_KINDS, once launched ("" = nothing was scheduled)
    launched_at: float = 0.0  # time.perf_counter() when its scheduling began (in the step before, if launched ahead)
    num_tokens: int = 0  # tokens the step computes (prompt and decode)
    adapters: int = 0  # distinct adapters whose rows its LoRA kernels read
    adapter_bytes: int = 0  # the bytes of those rows
    decode_keys: int = 0  # Σ over its one-token rows of the context each reads
    prompt_pairs: int = 0  # Σ over its prompt chunks' tokens of the keys each attends (causal)
    launch_done_at: float = 0.0  # time.perf_counter() once its last kernel was launched
    captures: int = 0  # decode graphs it captured at first use (cuda_graphs.DecodeGraphs.live_captures)
    capture_s: float = 0.0  # the host's seconds in those captures
    builds: int = 0  # Triton kernel variants built while its kernels were issued (kernel_builds.py)
    build_s: float = 0.0  # the host's seconds in those builds
    # CUDA events recorded on the stream before its first kernel and after its last (timing events, CUDA only):
    # the GPU's time from the step's start to its end, waits for the host inside the step included.
    gpu_events: tuple | None = None
    ahead: bool = False  # launched before the step before it had ended (lookahead.py)
    # Requests that ended (stop token) in the step before this one, which was launched before that was
    # known: their token here is dropped, and their slots are freed once this step is done with them.
    dropped: set = field(default_factory=set)
