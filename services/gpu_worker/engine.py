"""The engine: iteration-level continuous batching over the unified pool, in one process.

Every `step()`: 1) give running requests their next tokens' slots (evicting unused adapters, then
preempting the newest request, when slots are short) 2) admit waiting requests while slots, the token
budget and the running limit allow 3) build one ragged batch that mixes prefill chunks and decode tokens
of any adapters 4) forward 5) sample 6) finish and free. Requests join and leave at any step.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from pathlib import Path
from typing import Callable

import torch

from shared.config import EngineConfig
from shared.kernel_shapes import LaunchShapes
from shared.log import get_logger
from shared.lora_weights import LoraWeights
from shared.model_config import ModelConfig

from .adapter_layout import PackedAdapter, pack_adapter
from .adapter_copy import SideStreamCopier
from .batch_builder import build_batch
from .cuda_graphs import LORA_GROUPS, DecodeGraphs, groups_of_modules
from .decode_reserve import DecodeReserve
from .graph_stacks import GraphStacks
from .held_stacks import HeldStacks, held_bytes
from .kernel_builds import watch_builds
from .kernels.launch_shapes import launch_shapes, set_launch_shapes
from .lookahead import PENDING_TOKEN, ending_by_length, lookahead_rows, unfinished_prompts
from .merge_mode import MergeMode
from .model import LlamaModel
from .ops import select_backend
from .page_table import PageTable
from .pool import UnifiedPool
from .requests import EngineRequest, RequestOutput, Sequence, StepInFlight
from .resident_adapters import ResidentAdapters
from .sampling import GreedyTokens, finish_sampling
from .step_stats import HELD_BACK_REASONS, StepStats, step_gpu_seconds, step_kind
from .weights import ModelWeights, dummy_weights, load_weights

log = get_logger(__name__)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Waiting requests looked at per admission, at most: requests whose adapters are still being fetched are
# passed over, and the look past them is bounded so a long queue of such requests costs little per step.
ADMISSION_SCAN = 256


class Engine:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, config: EngineConfig,
                 adapter_loader: Callable[[str], PackedAdapter] | None = None, backend: str = "auto"):
        self.cfg = cfg
        self.config = config
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if cfg.sliding_window:
            # Within the window, full causal attention is exactly sliding-window attention; beyond it the
            # kernels would attend too far back, so the context stops at the window.
            self.max_model_len = min(self.max_model_len, cfg.sliding_window)
        self.ops = select_backend(self.device, backend, config.lora_mode)
        if config.direct_launch:
            from .kernels.compiled_launch import set_enabled

            set_enabled(True)  # process-wide, as Triton's own launch settings: one engine per worker process
        # Process-wide as well; every engine sets it, so one built after another starts from its own.
        set_launch_shapes(LaunchShapes.parse(config.kernel_shapes))
        self.model = LlamaModel(cfg, weights, self.ops, self.max_model_len)
        # Taken before the pool is sized from the memory left, which they would otherwise run out of.
        self.held_stacks = self._held_stacks()
        num_slots = config.num_slots or self._slots_from_memory()
        self.pool = UnifiedPool(cfg.num_layers, num_slots, cfg.kv_dim, self.dtype, self.device,
                                adapter_slots=config.adapter_pool_slots)
        self._local_adapters: dict[str, PackedAdapter] = {}
        self.copier = SideStreamCopier(self.pool) if self.device.type == "cuda" else None
        self.adapters = ResidentAdapters(self.pool, cfg, config.max_resident_adapters, config.max_lora_rank,
                                         adapter_loader or self._local_adapters.__getitem__,
                                         copy_rows=self.copier.copy if self.copier else None)
        # The merge baseline: adapters merged into the base weights, one per batch (merge_mode.py).
        self.merge = MergeMode(self, weights) if config.lora_mode == "merge" else None
        # One spare page-table row (and slot) for the padding rows of graph-replayed decode steps.
        self.page_table = PageTable(config.max_running_requests + 1, self.max_model_len, self.device)
        self.graphs = self._decode_graphs() if self.device.type == "cuda" and config.cuda_graphs else None
        # Slots held for the engine's whole life, by no request or adapter: the graphs' padding slot.
        self.reserved_slots = 1 if self.graphs is not None else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self._by_id: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []
        self._in_flight: StepInFlight | None = None
        self._ahead: StepInFlight | None = None  # launched by finish_step before the step before it ended
        self._deferred_aborts: list[str] = []
        self._order = 0
        self.num_preemptions = 0
        self.recomputed_tokens = 0  # tokens whose K/V preemptions threw away, to be computed again
        self.reserve = DecodeReserve(config.decode_reserve, min(config.decode_reserve_low, config.decode_reserve),
                                     config.decode_reserve_ease_s)
        self.step_stats = StepStats()  # steps, seconds and tokens by kind of step (step_stats.py)
        self.kernel_builds = watch_builds()  # kernels built under load, counted in the steps that met them
        self.admission_steps = 0  # steps that admitted waiting requests, launched ahead or not
        self.admissions_ahead = 0  # of those, steps launched ahead (overlap_admission)
        self.places_taken_ahead = 0  # requests ending by length whose places or slots such a step took early
        # Steps that could not be launched ahead of the last one's tokens, by why (overlap_steps): "prompt" (the
        # rest of a prompt whose request was aborted, or overlap_admission off), "batch" (a request left out
        # of the step, sampled on the host or asking for logits, or none continuing), "round" (an admission
        # round due with overlap_admission off, or only through the places of requests aborted while the step
        # ran), "slots" (the pool short even after evicting every unused adapter).
        self.held_back: Counter[str] = Counter(dict.fromkeys(HELD_BACK_REASONS, 0))
        self._admitting = False  # an admission round is under way (see _admission_due)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig, **kw) -> "Engine":
        cfg = ModelConfig.from_dir(model_dir)
        device, dtype = torch.device(config.device), DTYPES[config.dtype]
        return cls(cfg, load_weights(model_dir, cfg, dtype, device), config, **kw)

    @classmethod
    def with_dummy_weights(cls, cfg: ModelConfig, config: EngineConfig, **kw) -> "Engine":
        device, dtype = torch.device(config.device), DTYPES[config.dtype]
        return cls(cfg, dummy_weights(cfg, dtype, device, config.seed), config, **kw)

    def _decode_graphs(self) -> DecodeGraphs:
        scratch_slot = self.pool.allocator.allocate(1)[0]
        scratch_row = self.page_table.assign_row()
        self.page_table.append(scratch_row, 0, [scratch_slot])
        max_batch = min(self.config.cuda_graph_max_batch, self.config.max_running_requests)
        # Rows of zeros in every layer, read by a stacked graph's columns past its adapters' rows.
        zero_slot = self.pool.allocator.allocate(1)[0]
        self.pool.kv[:, :, zero_slot] = 0
        stacks = GraphStacks(self.cfg, LORA_GROUPS, self.pool.slot_width, zero_slot,
                             self.adapters.tables.ranks.shape[0], self.device, held=self.held_stacks)
        return DecodeGraphs(self.model, self.pool, self.adapters.tables, self.page_table, max_batch,
                            self.config.max_lora_rank, scratch_slot, scratch_row,
                            few_adapters=self.config.cuda_graph_few_adapters,
                            segment_programs=self.config.cuda_graph_segment_programs,
                            warm_groups=groups_of_modules(self.config.graph_lora_targets()), stacks=stacks)

    def _held_stacks(self) -> HeldStacks | None:
        """The held stacks' buffers (kernel_shapes graph_stacked_held), where decode graphs will read them."""
        shapes = launch_shapes()
        columns = shapes.graph_stacked_held
        if not (columns and shapes.graph_few_stacked and self.device.type == "cuda" and self.config.cuda_graphs):
            return None
        log.info("engine.held_stacks", columns=columns,
                 gb=round(held_bytes(self.cfg, LORA_GROUPS, self.cfg.kv_dim, columns, self.dtype) / 1e9, 2))
        return HeldStacks(self.cfg, LORA_GROUPS, self.cfg.kv_dim, columns, self.dtype, self.device)

    def _slots_from_memory(self) -> int:
        if self.device.type != "cuda":
            raise ValueError("num_slots = 0 (size from memory) needs a CUDA device")
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = UnifiedPool.bytes_for_pool(free, self.config.pool_memory_fraction, self.config.pool_headroom_gb)
        log.info("engine.pool_sized", free_gb=round(free / 2**30, 2), pool_gb=round(budget / 2**30, 2),
                 share=round(budget / free, 3))
        return UnifiedPool.slots_for_bytes(budget, self.cfg.num_layers, self.cfg.kv_dim, self.dtype)

    # ---- requests -------------------------------------------------------------------------------
    def register_adapter(self, name: str, weights: LoraWeights) -> PackedAdapter:
        """In-process adapter source (tests, demo); services load adapters from the arena instead."""
        packed = pack_adapter(weights, self.cfg, self.cfg.kv_dim, self.dtype)
        if self.device.type == "cuda":
            packed.rows = packed.rows.pin_memory()  # pinned, so loads are asynchronous DMA copies
        self._local_adapters[name] = packed
        return packed

    def add_request(self, req: EngineRequest) -> None:
        if req.request_id in self._by_id:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.sampling.validate()
        if not req.prompt_ids:
            raise ValueError("prompt must contain at least one token")
        total = len(req.prompt_ids) + req.sampling.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.sampling.max_tokens}) exceeds the context length {self.max_model_len}")
        if total > self.pool.allocator.num_slots:
            raise ValueError(f"prompt + max_tokens ({total}) cannot fit in the pool ({self.pool.allocator.num_slots} KV slots)")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.cfg.vocab_size})")
        seq = Sequence(req, self._order)
        self._order += 1
        self._by_id[req.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        seq = self._by_id.get(request_id)
        if seq is None:
            return False
        if self._in_flight is not None and seq in self._in_flight.scheduled:
            # Its slots may still be written by the step in flight: free them when that step is done.
            self._deferred_aborts.append(request_id)
            return True
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending or self._ahead)

    # ---- step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        return self.finish_step(self.launch_step())

    def launch_step(self) -> StepInFlight:
        """Schedule and launch one step without waiting for the GPU. The caller may do host work (emit the
        last step's tokens, drain its sockets, add or abort requests) before `finish_step`; aborts that
        arrive meanwhile take effect once the step's kernels are done with the request's slots."""
        if self._ahead is not None:
            flight, self._ahead = self._ahead, None
            flight.outputs, self._pending = self._pending, []
            self._let_go_staged()  # with every step launched ahead, the host's scheduling below never runs
            return flight
        started = time.perf_counter()  # the step's time includes scheduling it (step_stats.py)
        scheduled = self._schedule()
        self._let_go_staged()
        outputs, self._pending = self._pending, []
        return self._launch(scheduled, StepInFlight(outputs, launched_at=started))

    def _let_go_staged(self) -> None:
        """Unpin staged adapters no waiting request needs any more (theirs aborted), so the store may evict them."""
        if self.adapters.has_staged:
            self.adapters.keep_staged({s.req.adapter for s in self.waiting if s.req.adapter})

    def _launch(self, scheduled: list[tuple[Sequence, int]], flight: StepInFlight,
                device_tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepInFlight:
        if not scheduled:
            return flight
        flight.launched_at = flight.launched_at or time.perf_counter()
        builds, build_s = self.kernel_builds.totals()
        if self.copier is not None:
            self.copier.order_before_compute()
        gpu_start = None
        if self.device.type == "cuda":
            gpu_start = torch.cuda.Event(enable_timing=True)
            gpu_start.record()
        decode_only = self._is_decode(scheduled)
        if self.graphs is not None and decode_only and self.graphs.supports(len(scheduled)):
            samplers = [seq for seq, _ in scheduled]
            captures, capture_s = self.graphs.live_captures, self.graphs.live_capture_s
            logits = self.graphs.run(samplers, device_tokens)
            flight.captures = self.graphs.live_captures - captures
            flight.capture_s = self.graphs.live_capture_s - capture_s
            flight.replayed = True
        else:
            batch, samplers = build_batch(scheduled, self.adapters.tables, self.page_table, self.device)
            if device_tokens is not None:  # the first len(rows) requests decode: input i is request i's one token
                ids, rows = device_tokens
                batch.input_ids[:rows.shape[0]].copy_(ids.index_select(0, rows))
            logits = self.model.forward(batch, self.pool)
        for seq, n in scheduled:
            # The keys its queries attend: a one-token row reads its whole context (bytes); a chunk of a
            # prompt attends causally (FLOPs). Counted for the steps' floors (step_stats.py).
            before = seq.num_computed
            if n == 1:
                flight.decode_keys += before + 1
            else:
                flight.prompt_pairs += n * before + n * (n + 1) // 2
            seq.num_computed = before + n
            flight.num_tokens += n
        flight.kind = step_kind(flight.replayed, decode_only)
        flight.samplers, flight.logits = samplers, logits
        flight.scheduled = {seq for seq, _ in scheduled}
        if samplers:
            flight.greedy = GreedyTokens(logits)
        if gpu_start is not None:
            gpu_end = torch.cuda.Event(enable_timing=True)
            gpu_end.record()
            flight.gpu_events = (gpu_start, gpu_end)
        flight.launch_done_at = time.perf_counter()
        builds_after, build_s_after = self.kernel_builds.totals()
        flight.builds, flight.build_s = builds_after - builds, build_s_after - build_s
        # Counted once the kernels are queued: the GPU is busy meanwhile.
        flight.adapters, flight.adapter_bytes = self.adapters.rows_read({seq.req.adapter for seq, _ in scheduled})
        self._in_flight = flight
        return flight

    def _launch_ahead(self, flight: StepInFlight) -> StepInFlight | None:
        """Launch the next step of `flight`'s requests before `flight`'s tokens reach the host, when
        lookahead.py finds nothing the host would decide differently once it sees them: their decode rows,
        the rest of prompts `flight` began (with overlap_admission), and an admission round that is due."""
        if not self.config.overlap_steps or self.merge is not None:
            return None
        deferred = set(self._deferred_aborts)
        prompts = unfinished_prompts(flight, self.running)
        if prompts and (not self.config.overlap_admission or any(s.request_id in deferred for s in prompts)):
            self.held_back["prompt"] += 1
            return None
        rows = lookahead_rows(flight, len(self.running), deferred, self.max_model_len,
                              self.config.max_batched_tokens, unfinished=len(prompts))
        if rows is None:
            self.held_back["batch"] += bool(self.running)
            return None
        started = time.perf_counter()  # an admission round's scheduling counts in the step's launch, as on the host
        seqs = [flight.samplers[i] for i in rows]
        # Places taken early go to a round, so only where someone waits; their slots may be wanted below anyway.
        ending = ending_by_length(flight, rows, deferred, self.max_model_len) if self.waiting else None
        admit = self._round_ahead(len(flight.samplers) - len(flight.dropped) - len(seqs), len(ending or ()))
        if admit is None:
            self.held_back["round"] += 1
            return None
        budget = self.config.max_batched_tokens - len(seqs)
        chunks = []  # the prompts' next chunks, as the host's scheduler would give them after the decode rows
        for seq in prompts:
            if budget <= 0:
                break
            chunks.append((seq, min(seq.remaining, budget)))
            budget -= chunks[-1][1]
        # Evicting unused adapters for the KV slots, as the host's scheduler would: with many adapters the
        # pool is full of cached ones. Safe while `flight` runs: whatever this step writes into their slots
        # queues behind it on the compute stream, and an adapter copy's scatter waits for it as well.
        need = sum(self._slots_needed(seq, 1) for seq in seqs) + sum(self._slots_needed(seq, n) for seq, n in chunks)
        if self.config.overlap_ending_slots and not self.pool.allocator.can_allocate(need):
            # Short of slots: those of requests ending by length at `flight` go first, as the host frees them
            # once its tokens are in, before it evicts an adapter or preempts anyone. With the pool binding,
            # nearly every step met this and waited for the step before (S2 n = 2000 on an H100: 2,100 of
            # ~3,100 steps).
            if ending is None:
                ending = ending_by_length(flight, rows, deferred, self.max_model_len)
            for seq in ending:
                self._leave_early(seq)
            ending = []
        if not self.adapters.evict_until(need):
            self.held_back["slots"] += 1
            return None
        # Slots go out below all at once, checked once here: runs only if every request's whole run fits.
        run = self.config.kv_slot_run
        runs = run > 1 and self.pool.allocator.can_allocate(need + (run - 1) * (len(seqs) + len(chunks)))
        if admit:
            for seq in ending or ():
                self._leave_early(seq)
        for seq in seqs:
            seq.tokens.append(PENDING_TOKEN)
            self._give_slots(seq, 1, runs)
        for seq, n in chunks:
            self._give_slots(seq, n, runs)
        # Prompt tokens follow the decode rows, whose input tokens are still on the device: the host schedules
        # and launches this eager step while the GPU runs `flight`, instead of after it.
        scheduled = [(seq, 1) for seq in seqs] + chunks
        if admit:
            before = len(scheduled)
            self._admit(scheduled, budget)
            self.admissions_ahead += len(scheduled) > before
        index = torch.tensor(rows, dtype=torch.int32)
        if self.device.type == "cuda":
            index = index.pin_memory().to(self.device, non_blocking=True)
        return self._launch(scheduled, StepInFlight([], launched_at=started, ahead=True),
                            (flight.greedy.device_ids, index))

    def _round_ahead(self, finishing: int, ending: int) -> bool | None:
        """Whether the step launched ahead admits waiting requests; None: it cannot go ahead at all.
        `finishing`: requests of the step in flight that do not continue; `ending`: those of them known on
        the host to end by length, whose places the round may take early."""
        admit = self._admitting or self._admission_due()
        if admit and not self.config.overlap_admission:
            return None
        if not admit and self._admission_due(finishing):
            # The round needs the places of requests leaving at the step in flight. Those ending by length
            # may be taken now; those aborted during it are freed only once it ends: then the round is
            # scheduled once the step's tokens are in. (One ending by a stop token is not among `finishing`:
            # nobody knows it yet, so it counts as continuing.)
            if not self.config.overlap_admission or not self._admission_due(ending):
                return None
            admit = True
        return admit

    def finish_step(self, flight: StepInFlight) -> list[RequestOutput]:
        """Launch the next step if it can go ahead of this one's tokens (lookahead.py), then wait for this
        step's tokens, apply stop conditions, free what finished."""
        self._in_flight = None
        ahead = self._launch_ahead(flight)
        outputs = flight.outputs
        if flight.samplers:
            samplers = flight.samplers
            tokens = finish_sampling(flight.greedy, flight.logits, [s.req.sampling for s in samplers],
                                     [s.generator for s in samplers])
            carried = ahead.scheduled if ahead is not None else ()
            for row, (seq, token) in enumerate(zip(samplers, tokens)):
                if seq in flight.dropped:
                    continue
                if seq in carried:
                    seq.tokens[-1] = token  # the step ahead already runs it from the device
                else:
                    seq.tokens.append(token)
                out = RequestOutput(seq.request_id, [token], prompt_tokens=seq.prompt_len,
                                    completion_tokens=seq.num_output)
                if seq.req.return_logits:
                    # A copy even on the CPU: the decode graphs' logits buffer is written again by the next step.
                    out.logits = [flight.logits[row].to("cpu", copy=True)]
                reason = self._stop_reason(seq, token)
                if reason:
                    if seq in carried:
                        # The step ahead still writes its slots: it leaves now, its slots when that step ends.
                        self.running.remove(seq)
                        self._by_id.pop(seq.request_id, None)
                        ahead.dropped.add(seq)
                    else:
                        self._release(seq)
                    out.finished, out.finish_reason = True, reason
                outputs.append(out)
        if flight.kind:  # its tokens are on the host (or it sampled nothing): the step is done
            self.step_stats.record(flight.kind, flight.launched_at, flight.num_tokens, launched=flight.launch_done_at,
                                   ahead=flight.ahead, adapters=flight.adapters, adapter_bytes=flight.adapter_bytes,
                                   decode_keys=flight.decode_keys, prompt_pairs=flight.prompt_pairs,
                                   sampled=len(flight.samplers), captures=flight.captures,
                                   capture_s=flight.capture_s, builds=flight.builds, build_s=flight.build_s,
                                   gpu_s=step_gpu_seconds(flight))
        for seq in flight.dropped:
            self._release_slots(seq)
        self._ahead = ahead
        deferred, self._deferred_aborts = self._deferred_aborts, []
        for request_id in deferred:
            self.abort(request_id)
        return outputs

    @staticmethod
    def _is_decode(scheduled: list[tuple[Sequence, int]]) -> bool:
        return all(n == 1 and seq.remaining == 1 for seq, n in scheduled)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.req.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.cfg.eos_token_ids):
            return "stop"
        if seq.num_output >= sp.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def _schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.config.max_batched_tokens
        alloc = self.pool.allocator
        scheduled: list[tuple[Sequence, int]] = []
        # Oldest first; preemption pops the newest off the end, so the loop simply ends sooner.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.remaining, budget)
            need = self._slots_needed(seq, n)
            while (not alloc.can_allocate(need) and not self.adapters.evict_until(need)
                   and not self._reclaim_spare_slots(need, keep=seq) and i < len(self.running)):
                self._preempt_newest()
            if i == len(self.running):
                break  # seq itself was the newest and is now back in the waiting queue
            self._give_slots(seq, n)
            scheduled.append((seq, n))
            budget -= n
            i += 1
        if self.merge is not None:
            self.merge.before_admission()
        return self._admit(scheduled, budget)

    def _admit(self, scheduled: list[tuple[Sequence, int]], budget: int) -> list[tuple[Sequence, int]]:
        """Append to `scheduled` the waiting requests an admission round takes now, within `budget` tokens."""
        self._admitting = self._admitting or self._admission_due()
        before = len(scheduled)
        share = self.reserve.share() if self._admitting and self.waiting else 0.0
        kept = self.reserve.slots(map(self._remaining_output, self.running), share) if share else 0
        # One slot a running request for each of the next decode_margin_steps steps, so the step launched
        # ahead finds its decode tokens' slots without waiting for the step before to free any (lookahead.py).
        margin = self.config.decode_margin_steps
        kept += margin * len(self.running)
        i = 0  # position in the waiting queue
        passed = 0  # waiting requests passed over because their adapter is still on its way from the store
        while (self._admitting and i < len(self.waiting) and passed < ADMISSION_SCAN and budget > 0
               and len(self.running) < self.config.max_running_requests):
            seq = self.waiting[i]
            n = min(seq.remaining, budget)
            name = seq.req.adapter
            if self.merge is not None:
                if not self.merge.admits(seq):
                    # Another adapter's (or a later arrival's): it waits for its own group. Not counted as
                    # passed over: the group's members may sit anywhere in the queue, and each is a set lookup.
                    i += 1
                    continue
                name = None  # its adapter is merged into the weights: it runs as a base-model request
            if name and not self.adapters.ready(name):
                i += 1  # its load has started; requests behind it go first instead of the step waiting
                passed += 1
                continue
            try:
                need = n + (self.adapters.slots_to_load(name) if name else 0)
            except (KeyError, ValueError) as exc:
                del self.waiting[i]
                self._fail(seq, f"adapter {name!r} cannot be loaded: {exc}")
                continue
            # Admit only what fits now (evicting unused adapters if needed), beside the slots kept back for the
            # decode tokens of those running and of this one: a request never holds an adapter's slots while it
            # waits, nor takes the slots a running request is about to need.
            own = self.reserve.slots([self._remaining_output(seq)], share) if share else 0
            fits = self.adapters.can_make_room(need + kept + own, keep=name)
            if not fits and self._reclaim_spare_slots():
                fits = self.adapters.can_make_room(need + kept + own, keep=name)
            if not fits:
                if not self.running:
                    del self.waiting[i]
                    self._fail(seq, f"request needs {need} slots (KV and adapter); the pool has {self.pool.num_slots}")
                    continue
                break
            if name:
                try:
                    seq.adapter = self.adapters.acquire(name)
                except (KeyError, ValueError) as exc:
                    del self.waiting[i]
                    self._fail(seq, f"adapter {name!r} cannot be loaded: {exc}")
                    continue
            self.adapters.evict_until(n)
            del self.waiting[i]
            seq.order = self._order
            self._order += 1
            seq.row = self.page_table.assign_row()
            self._give_slots(seq, n)
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            kept += own + margin
        if not self.waiting or len(self.running) >= self.config.max_running_requests:
            self._admitting = False  # the round is over: the batch is full or nobody waits
        self.admission_steps += len(scheduled) > before
        return scheduled

    @property
    def lookahead_steps(self) -> int:
        """Steps launched before the tokens of the step before reached the host (finished ones)."""
        return sum(self.step_stats.ahead.values())

    @property
    def admission_round(self) -> int:
        """Requests admitted together once a busy batch has room for them (1 = one at a time)."""
        return min(self.config.admission_batch, max(1, self.config.max_running_requests // 8))

    def _admission_due(self, finishing: int = 0) -> bool:
        """Whether an admission round starts now. Each step that admits requests carries their prefill and
        runs eagerly (only pure decode steps replay CUDA graphs); admitting one request as each finishes would
        make nearly every step eager at saturation. So with a busy batch, admission waits until a round's
        worth of places is free, then continues step after step until the batch is full or the queue empty.
        A round's worth is at most what waits; with admission_wait_s it is a whole round unless a request has
        waited that long, since the queue, refilled one request per finished one, is short right after a round."""
        if not self.waiting:
            return False
        if not self.running:
            return True
        free = self.config.max_running_requests - len(self.running) + finishing
        if free < min(self.admission_round, len(self.waiting)):
            return False
        wait_s = self.config.admission_wait_s
        if not wait_s or free >= self.admission_round:
            return True
        return time.monotonic() - min(seq.queued_at for seq in self.waiting) >= wait_s

    def _remaining_output(self, seq: Sequence) -> int:
        return DecodeReserve.remaining_output(seq.req.sampling.max_tokens, seq.num_output, len(seq.tokens),
                                              self.max_model_len)

    @staticmethod
    def _slots_needed(seq: Sequence, n: int) -> int:
        """Slots the pool must have free for n more of seq's tokens (its spare ones come first)."""
        return max(0, n - len(seq.spare_slots))

    def _reclaim_spare_slots(self, need: int | None = None, keep: Sequence | None = None) -> bool:
        """Give running requests' spare slots (but keep's, whose need counted them) back to the pool, newest
        request first, until `need` are free (None: all of them): the cheapest memory there is to free before
        preempting. Whether `need` are free now (None: whether any were given back)."""
        alloc = self.pool.allocator
        if self.config.kv_slot_run == 1:
            return False  # nobody holds spare slots; callers only ask when `need` are not free
        given = False
        for seq in reversed(self.running):
            if need is not None and alloc.can_allocate(need):
                break
            if seq.spare_slots and seq is not keep:
                alloc.free(seq.spare_slots)
                seq.spare_slots = []
                given = True
        return given if need is None else alloc.can_allocate(need)

    def _give_slots(self, seq: Sequence, n: int, runs: bool = True) -> None:
        """n more KV slots for seq: its spare ones first, then from the pool, rounded up to a whole run of
        kv_slot_run where the pool has that many free (the rest kept as spare); callers check that n fit, and
        one giving several requests slots after a single check passes `runs` (whether all their runs fit)."""
        new: list[int] = []
        if seq.spare_slots:
            new = seq.spare_slots[:n]
            del seq.spare_slots[:n]
        need = n - len(new)
        if need:
            alloc = self.pool.allocator
            extra = -(len(seq.slots) + n) % self.config.kv_slot_run if runs else 0
            if extra and not alloc.can_allocate(need + extra):
                extra = 0
            taken = alloc.allocate(need + extra)
            new += taken[:need]
            seq.spare_slots = taken[need:]
        self.page_table.append(seq.row, len(seq.slots), new)
        seq.slots += new

    def _preempt_newest(self) -> None:
        """Free the newest running request's KV and queue it first in line; it is recomputed when readmitted."""
        seq = self.running.pop()
        log.debug("engine.preempt", request_id=seq.request_id, tokens=len(seq.tokens))
        self._release_slots(seq)
        self.recomputed_tokens += seq.num_computed
        seq.num_computed = 0
        self.num_preemptions += 1
        self.reserve.preempted()
        self.waiting.appendleft(seq)

    def _release_slots(self, seq: Sequence) -> None:
        if seq.slots or seq.spare_slots:
            self.pool.allocator.free(seq.slots + seq.spare_slots)
            seq.slots, seq.spare_slots = [], []
        if seq.row is not None:
            self.page_table.release_row(seq.row)
            seq.row = None
        if seq.adapter is not None:
            self.adapters.release(seq.adapter.name)
            seq.adapter = None

    def _leave_early(self, seq: Sequence) -> None:
        """Give a request's place, row, slots and adapter to the round launched ahead while the step sampling
        its last token is still in flight. That step's kernels are the last to touch them: the step ahead is
        queued behind it on the compute stream, and an adapter copy into freed slots waits for the compute
        stream first (adapter_copy.py). Its token still reaches the client when that step ends."""
        self.running.remove(seq)
        self._release_slots(seq)
        self.places_taken_ahead += 1

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_slots(seq)
        self._by_id.pop(seq.request_id, None)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self._release(seq)
        self._pending.append(RequestOutput(seq.request_id, [], True, reason, seq.prompt_len, seq.num_output, error))

    def _fail(self, seq: Sequence, message: str) -> None:
        log.warning("engine.request_failed", request_id=seq.request_id, error=message)
        self._finish(seq, "error", message)

    # ---- reporting ------------------------------------------------------------------------------
    def capacity(self) -> dict:
        pool = self.pool
        adapter_slots = self.adapters.slots_in_use
        return {
            "total_slots": pool.num_slots,
            "free_slots": pool.num_free,
            # Unused adapters stay resident until their slots are wanted: in the unified pool those slots
            # are KV's on demand, and the scheduler must count them or it stops sending work to a pool that
            # is full of them.
            "evictable_slots": self.adapters.unused_slots if pool.unified else 0,
            "adapter_slots": adapter_slots,
            "kv_slots": pool.num_used - adapter_slots,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "resident_adapters": self.adapters.names,
            "preemptions": self.num_preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "decode_reserve_share": round(self.reserve.share(), 3),
            "adapter_loads": self.adapters.loads,
            "adapter_bytes_loaded": self.adapters.bytes_loaded,
            "step_stats": self.step_stats,
            "held_back": dict(self.held_back),
        }
