"""The limit a point is measured against (BENCHMARKS.md "The limit"), from ceilings measured in the same run.

Ceilings (`measure_ceilings`): device-to-device copy bandwidth (bytes read + written per second, the HBM
figure decode is bound by), a large bf16 matmul (FLOP/s, what prefill is bound by) and a pinned
host-to-device copy (what adapter loads from the host cache are bound by). On a CPU the same measurements
run at tiny sizes in fp32 (host memory is not pinned there), so the code path is tested without a GPU.

Per request of a trace, with prompt p and output o (the first output token comes from the prefill, the
other o - 1 from decode steps):
- decode bytes = (o - 1) · (W / batch) + kv · Σ_{k=1}^{o-1} (p + k) + (o - 1) · A / s
  W: the base weights every step reads (every layer's linears, norms and the LM head; not the embedding
  table, of which a step reads one row per request), amortised over the batch; kv: KV bytes per token (all
  layers, K and V), read for the whole context at every step; A: the bytes of the request's adapter,
  shared by the s requests of the same adapter among the `batch` requests around it in the trace.
- prefill FLOPs = 2·p·(base linear parameters) + 2·p·r·Σ(in + out) over adapted modules
  + 4·q_dim·p(p + 1)/2 per layer (causal attention: scores and values) + 2·hidden·vocab (LM head, last token).
- time = decode bytes / HBM bandwidth + prefill FLOPs / matmul rate.
The roofline throughput of the trace is its request count over the sum of those times: the GPU does each
request's share of work one batch after another, at best at the measured ceilings.

The roofline counts decode as bytes only. Past the GPU's ridge point (matmul rate over copy rate, ~180 FLOP a
byte on an H200) a step's linears are bound by their FLOPs instead: 2 FLOPs per weight per token, against
weight bytes read once for the whole batch, so at a batch of a few hundred tokens the GEMMs take longer than
their bytes. `attainable_rps` is the throughput of a server whose every operation runs at the ceiling that
binds it: a decode step's linears and its LM head each take the longer of their weight bytes over the copy
rate and their FLOPs over the matmul rate; norms, KV and adapter rows are read at the copy rate (attention
and the LoRA kernels do ~1–4 FLOPs a byte, far below the ridge, so their FLOPs never bind); prefill as in the
roofline. Its ratio to the roofline is the most of the roofline any server reaches on the trace at that batch.

The matmul ceiling is a burst: 20 products timed back to back, at the SM clock the GPU holds before its power
draw reaches the board's limit. Under sustained FLOP-bound work the limit pulls the clock down (an H100 at
700 W held 0.85 of its burst rate: benchmarks/sustained_matmul.py, docs/benchmarks.md), so a roofline from the
burst rate is the stricter of the two; points are judged against it, and carry the roofline at the held rate
beside it (`roofline_rps_held`, `roofline_fraction_held`) where their ceilings hold it.

Batch: the server's largest running batch (EngineConfig.max_running_requests, 256), capped, when the pool's
size is known, by how many requests' KV it holds at the trace's mean context beside the rows of the adapters
such a batch uses (`server_batch`; on an H200 the cap binds first at every setting's n, on an 80 GB card at S2
n = 2000 the adapters take ~20% of the pool).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Sequence

from bench.settings import Setting

MAX_RUNNING = 256  # EngineConfig.max_running_requests


@dataclass(frozen=True)
class Ceilings:
    device: str
    name: str  # GPU name (or "cpu")
    hbm_gbs: float  # device-to-device copy, (read + written) bytes per second / 1e9
    matmul_tflops: float
    h2d_gbs: float  # host-to-device copy from pinned memory (a plain host copy on CPU)
    copy_bytes: int
    matmul_n: int
    matmul_dtype: str
    pinned: bool
    # The same product run back to back until the board's power limit sets the clock (bench/held_matmul.py);
    # None where not measured (lines from before it, ceilings given by hand).
    matmul_held_tflops: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _timer(device: str):
    import torch

    if device.startswith("cuda"):
        def timed(fn, repeats: int) -> float:
            fn()  # warm-up (allocations, kernel selection)
            torch.cuda.synchronize(device)
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return sorted(times)[len(times) // 2]
    else:
        def timed(fn, repeats: int) -> float:
            fn()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]
    return timed


def _copy_seconds(timed, device: str, nbytes: int, repeats: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), repeats)


def _matmul_seconds(timed, device: str, n: int, dtype, repeats: int) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return timed(lambda: torch.mm(a, b), repeats)


def _host_to_device_seconds(timed, device: str, nbytes: int, repeats: int) -> float:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8)
    if device.startswith("cuda"):
        host = host.pin_memory()  # pin_memory() raises without CUDA: only here
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return timed(lambda: dev.copy_(host, non_blocking=True), repeats)
    dev = torch.empty_like(host)
    return timed(lambda: dev.copy_(host), repeats)


def measure_ceilings(device: str = "cuda", copy_bytes: int = 0, matmul_n: int = 0, repeats: int = 0,
                     held_s: float = -1.0) -> Ceilings:
    """Median of `repeats` timed runs of each measurement (sizes default to 2 GiB and 8192 on CUDA, 32 MiB
    and 256 on CPU), and the matmul rate held over `held_s` seconds of back-to-back products (default 6 on
    CUDA, where the clock settles within a second, 0.3 on a CPU; 0: not measured)."""
    import torch

    from bench.held_matmul import measure_held_tflops

    on_cuda = device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        raise RuntimeError("measure_ceilings: device cuda asked for, but no CUDA GPU is visible")
    copy_bytes = copy_bytes or (2 * 2**30 if on_cuda else 32 * 2**20)
    matmul_n = matmul_n or (8192 if on_cuda else 256)
    repeats = repeats or (20 if on_cuda else 5)
    dtype = torch.bfloat16 if on_cuda else torch.float32
    timed = _timer(device)

    t_copy = _copy_seconds(timed, device, copy_bytes, repeats)
    t_mm = _matmul_seconds(timed, device, matmul_n, dtype, repeats)
    t_h2d = _host_to_device_seconds(timed, device, copy_bytes, repeats)
    held_s = held_s if held_s >= 0 else (6.0 if on_cuda else 0.3)
    held_rate = measure_held_tflops(device, matmul_n, held_s, 0.5 if on_cuda else 0.05) if held_s else None
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    if on_cuda:
        torch.cuda.empty_cache()
    return Ceilings(device=device, name=name, hbm_gbs=2 * copy_bytes / t_copy / 1e9,
                    matmul_tflops=2 * matmul_n**3 / t_mm / 1e12, h2d_gbs=copy_bytes / t_h2d / 1e9,
                    copy_bytes=copy_bytes, matmul_n=matmul_n, matmul_dtype=str(dtype).removeprefix("torch."),
                    pinned=on_cuda, matmul_held_tflops=held_rate)


def held(ceilings: Ceilings) -> Ceilings | None:
    """The same ceilings with the matmul rate the GPU holds in place of its burst; None where not measured."""
    if ceilings.matmul_held_tflops is None:
        return None
    return replace(ceilings, matmul_tflops=ceilings.matmul_held_tflops)


# ---- model arithmetic -----------------------------------------------------------------------------------

def linear_params(setting: Setting) -> int:
    """Parameters of every layer's seven linears."""
    from shared.model_config import MODULES

    cfg = setting.model_config
    return cfg.num_layers * sum(i * o for i, o in (cfg.module_dims(m) for m in MODULES))


def decode_weight_bytes(setting: Setting, dtype_bytes: int = 2) -> int:
    """Base weight bytes one decode step reads: linears, norms and the LM head (see the module doc)."""
    cfg = setting.model_config
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    return (linear_params(setting) + norms + cfg.hidden_size * cfg.vocab_size) * dtype_bytes


def kv_bytes_per_token(setting: Setting, dtype_bytes: int = 2) -> int:
    cfg = setting.model_config
    return 2 * cfg.num_layers * cfg.kv_dim * dtype_bytes


def adapter_read_bytes(setting: Setting, rank: int, dtype_bytes: int = 2) -> int:
    return setting.adapter_params(rank) * dtype_bytes


def bound_seconds(nbytes: float, flops: float, ceilings: Ceilings) -> float:
    """An operation at the ceiling that binds it: the longer of its bytes at the copy rate and its FLOPs at the
    matmul rate."""
    return max(nbytes / (ceilings.hbm_gbs * 1e9), flops / (ceilings.matmul_tflops * 1e12))


@dataclass(frozen=True)
class RequestCost:
    weight_bytes: float  # this request's share of the base weights, over all its decode steps
    kv_bytes: int
    adapter_bytes: float
    prefill_flops: int
    # Of weight_bytes, the linears' and the LM head's shares, and the FLOPs their decode steps do for this
    # request (attainable_seconds; 0 where a cost was written without them).
    linear_weight_bytes: float = 0.0
    head_weight_bytes: float = 0.0
    decode_linear_flops: int = 0
    decode_head_flops: int = 0

    @property
    def decode_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.adapter_bytes

    def seconds(self, ceilings: Ceilings) -> float:
        return self.decode_bytes / (ceilings.hbm_gbs * 1e9) + self.prefill_flops / (ceilings.matmul_tflops * 1e12)

    def attainable_seconds(self, ceilings: Ceilings) -> float:
        """Each decode operation at the ceiling that binds it (module doc): never less than `seconds`."""
        streamed = self.decode_bytes - self.linear_weight_bytes - self.head_weight_bytes
        return (bound_seconds(self.linear_weight_bytes, self.decode_linear_flops, ceilings)
                + bound_seconds(self.head_weight_bytes, self.decode_head_flops, ceilings)
                + bound_seconds(streamed, 0, ceilings) + bound_seconds(0, self.prefill_flops, ceilings))


def request_cost(setting: Setting, prompt_len: int, output_len: int, batch: int, rank: int = 0,
                 adapter_sharers: int = 1, dtype_bytes: int = 2) -> RequestCost:
    """Bytes and FLOPs of one request (module doc); rank 0 = the base model; `adapter_sharers` = requests of
    the same adapter among the batch around this one (this one included)."""
    if batch < 1 or adapter_sharers < 1:
        raise ValueError(f"batch and adapter_sharers must be >= 1, got {batch} and {adapter_sharers}")
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt and output lengths must be >= 1, got {prompt_len} and {output_len}")
    cfg = setting.model_config
    p, steps = prompt_len, output_len - 1
    kv_tokens = steps * p + steps * (steps + 1) // 2  # Σ_{k=1}^{o-1} (p + k)
    attention = 4 * cfg.q_dim * (p * (p + 1) // 2) * cfg.num_layers
    lora = 2 * p * setting.adapter_params(rank) if rank else 0
    linear, head = linear_params(setting), cfg.hidden_size * cfg.vocab_size
    return RequestCost(
        weight_bytes=steps * decode_weight_bytes(setting, dtype_bytes) / batch,
        kv_bytes=kv_tokens * kv_bytes_per_token(setting, dtype_bytes),
        adapter_bytes=steps * adapter_read_bytes(setting, rank, dtype_bytes) / adapter_sharers if rank else 0.0,
        prefill_flops=2 * p * linear + lora + attention + 2 * head,
        linear_weight_bytes=steps * linear * dtype_bytes / batch,
        head_weight_bytes=steps * head * dtype_bytes / batch,
        decode_linear_flops=steps * 2 * linear,
        decode_head_flops=steps * 2 * head,
    )


def _windows(trace: Sequence, batch: int) -> list[Sequence]:
    """The trace cut into batch-sized windows, in order: the batches the roofline's server runs."""
    return [trace[start:start + batch] for start in range(0, len(trace), batch)]


def _sharers(trace: Sequence, batch: int) -> list[int]:
    """For each request, how many requests of its adapter are in its batch-sized window of the trace."""
    out = []
    for window in _windows(trace, batch):
        counts: dict = {}
        for r in window:
            counts[r.adapter] = counts.get(r.adapter, 0) + 1
        out += [counts[r.adapter] for r in window]
    return out


def _rank_of(setting: Setting, adapter: int | None, ranks: Sequence[int] | None) -> int:
    if adapter is None:
        return 0
    if ranks is None:
        return round(setting.mean_rank)
    return int(ranks[adapter])


def trace_seconds(setting: Setting, trace: Sequence, ceilings: Ceilings, batch: int,
                  ranks: Sequence[int] | None = None, dtype_bytes: int = 2, attainable: bool = False) -> float:
    """Σ over the trace of each request's roofline time (`attainable`: its time with each operation at the
    ceiling that binds it). `ranks[i]` is adapter i's rank (default: the setting's mean rank for every
    adapter)."""
    sharers = _sharers(trace, batch)
    costs = (request_cost(setting, r.prompt_len, r.output_len, batch, _rank_of(setting, r.adapter, ranks), s,
                          dtype_bytes) for r, s in zip(trace, sharers))
    return sum(c.attainable_seconds(ceilings) if attainable else c.seconds(ceilings) for c in costs)


def roofline_rps(setting: Setting, trace: Sequence, ceilings: Ceilings, batch: int,
                 ranks: Sequence[int] | None = None, dtype_bytes: int = 2) -> float:
    """Requests per second the trace could be served at if every byte and FLOP ran at the ceilings."""
    if not trace:
        raise ValueError("roofline of an empty trace")
    return len(trace) / trace_seconds(setting, trace, ceilings, batch, ranks, dtype_bytes)


def attainable_rps(setting: Setting, trace: Sequence, ceilings: Ceilings, batch: int,
                   ranks: Sequence[int] | None = None, dtype_bytes: int = 2) -> float:
    """Requests per second with every operation at the ceiling that binds it (module doc): at most the
    roofline, and its ratio to it the most of the roofline any server reaches at this batch."""
    if not trace:
        raise ValueError("attainable throughput of an empty trace")
    return len(trace) / trace_seconds(setting, trace, ceilings, batch, ranks, dtype_bytes, attainable=True)


def roofline_fraction(throughput_rps: float, setting: Setting, trace: Sequence, ceilings: Ceilings, batch: int,
                      ranks: Sequence[int] | None = None, dtype_bytes: int = 2) -> float:
    return throughput_rps / roofline_rps(setting, trace, ceilings, batch, ranks, dtype_bytes)


def server_batch(setting: Setting, trace: Sequence, max_running: int = MAX_RUNNING, pool_slots: int = 0,
                 ranks: Sequence[int] | None = None) -> int:
    """The running batch the roofline assumes (module doc): `max_running`, capped by the KV the pool holds
    at the trace's mean context (prompt + half the output) when `pool_slots` is known, beside the rows of the
    adapters a batch that size uses (`ranks` as in trace_seconds; all rank 0 for the base model): any server
    holds those on the GPU, and in one pool they take the slots of KV."""
    if not pool_slots or not trace:
        return max_running
    mean_context = sum(r.prompt_len + r.output_len / 2 for r in trace) / len(trace)
    batch = max(1, min(max_running, int(pool_slots // mean_context)))
    # Scanned down from the KV-only cap, a smaller batch using fewer adapters: the first batch that fits is
    # taken (a pool that does not bind keeps the cap after one look).
    while batch > 1 and batch * mean_context + batch_adapter_slots(setting, trace, batch, ranks) > pool_slots:
        batch -= 1
    return batch


def batch_adapter_slots(setting: Setting, trace: Sequence, batch: int, ranks: Sequence[int] | None = None) -> float:
    """Pool slots the distinct adapters of a `batch`-sized window of the trace take, averaged over its
    windows (those of _sharers; a trace shorter than one batch is one window)."""
    from bench.stack import adapter_slots

    windows = _windows(trace, batch)
    full = [w for w in windows if len(w) == batch] or windows
    slots_of_rank: dict[int, int] = {0: 0}  # a few ranks, asked for each adapter of every window
    total = 0
    for window in full:
        for adapter in {r.adapter for r in window}:
            rank = _rank_of(setting, adapter, ranks)
            if rank not in slots_of_rank:
                slots_of_rank[rank] = adapter_slots(setting, rank)
            total += slots_of_rank[rank]
    return total / len(full)
