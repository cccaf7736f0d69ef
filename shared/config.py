"""Typed configuration. Field docs double as CLI help; unknown keys are rejected."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass, field, fields

from .kernel_shapes import LaunchShapes
from .model_config import MODULES


def doc_field(text: str, default):
    """A config field whose doc string becomes its `--help` text."""
    return field(default=default, metadata={"doc": text})


_doc = doc_field

LORA_MODES = ("unified", "bmm", "merge")
# Resident table rows when not set: a row costs max_slots int32s on the GPU (11 KB for a rank-256 row of
# Llama-2-7B shapes, 46 MB for all), and capping residents at the running batch made a worker copy adapters in
# again and again at n = 2000 while its pool had room for ~750 more (docs/benchmarks.md).
DEFAULT_RESIDENT_ADAPTERS = 4096


def _number(value) -> bool:
    """An int or a float, and not a bool (which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value, low: int, high: float = float("inf")) -> bool:
    """An int from low to high, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@dataclass
class EngineConfig:
    """Settings of one engine (one GPU worker or TP group)."""

    device: str = _doc("torch device: cpu or cuda[:N]", "cpu")
    dtype: str = _doc("compute dtype: float32, float16 or bfloat16", "float32")
    num_slots: int = _doc("slots in the unified pool (KV tokens and adapter rows share them); 0 = size from the "
                          "free GPU memory (pool_headroom_gb, pool_memory_fraction)", 4096)
    pool_memory_fraction: float = _doc("fraction of free GPU memory the pool takes at most when num_slots is 0 "
                                       "(on a 141 GB card 0.94 leaves ~7.5 GiB, above every served peak beside "
                                       "the pool)", 0.94)
    pool_headroom_gb: float = _doc("GiB of the free GPU memory left beside the pool when num_slots is 0, for steps' "
                                   "activations, the decode graphs and the allocator's cache: served peaks took "
                                   "2.3-5.3 GiB with Llama-2-7B and Llama-3-8B shapes at running batches of "
                                   "384-512 on H100 and H200 (docs/benchmarks.md, 2026-12-07); an amount, not a "
                                   "share, since they do not grow with the card", 6.0)
    max_lora_rank: int = _doc("largest adapter rank accepted", 256)
    max_resident_adapters: int = _doc("adapters kept in the pool at once (resident table rows); 0 = "
                                      f"{DEFAULT_RESIDENT_ADAPTERS} (at least max_running_requests): unused ones stay "
                                      "until KV or another adapter needs their slots, so the pool, not this, bounds "
                                      "them", 0)
    max_running_requests: int = _doc("requests in the running batch at most", 256)
    max_batched_tokens: int = _doc("tokens per step at most (prefill chunks + decodes)", 2048)
    admission_batch: int = _doc("with a full running batch, admit waiting requests once this many places are free "
                                "(capped at max_running_requests / 8 and at the queue length), so prefill runs in "
                                "few eager steps and decode steps stay graph-replayed; 1 = admit at every step", 32)
    admission_wait_s: float = _doc("with a busy batch, a round starts once a whole round's places are free, or once "
                                   "the longest-waiting request has waited this long; 0 = as soon as every waiting "
                                   "request has a place (the scheduler refills the queue one request per finished "
                                   "one, so at saturation rounds then shrink to a few prompts each; holding them for 0.5 s "
                                   "cost S2 11-15% of its throughput on an H200, docs/benchmarks.md)", 0.0)
    decode_reserve: float = _doc("share of the running requests' remaining output tokens (to max_tokens) whose KV "
                                 "slots admission keeps free, so that admitting a prompt does not force a running "
                                 "request out to be recomputed later; taken at every preemption, then eased to "
                                 "decode_reserve_low over decode_reserve_ease_s (services/gpu_worker/"
                                 "decode_reserve.py); 0 = admit whatever fits now", 0.0)
    decode_reserve_low: float = _doc("the share decode_reserve eases down to while no request is preempted", 0.1)
    decode_reserve_ease_s: float = _doc("seconds without a preemption for decode_reserve to ease down to "
                                        "decode_reserve_low", 20.0)
    decode_margin_steps: int = _doc("decode steps' worth of KV slots (one a running request a step) that admission "
                                    "leaves free, so that where the pool binds the next step can still be launched "
                                    "ahead of the last one's tokens instead of waiting for them to free slots; "
                                    "0 = admit whatever fits now", 0)
    max_model_len: int = _doc("prompt + output tokens at most; 0 = model's max_position_embeddings", 0)
    seed: int = _doc("seed for dummy weights", 0)
    cuda_graphs: bool = _doc("replay decode steps from CUDA graphs (CUDA only)", True)
    overlap_steps: bool = _doc("launch the next decode step before the last step's tokens reach the host (greedy "
                               "batches), so host work hides behind the GPU; served S2 on an H200 at a batch of 384 "
                               "ran 2-11% faster with it than without (n = 100, 2000, 5; docs/benchmarks.md, "
                               "2026-12-04)", True)
    overlap_admission: bool = _doc("with overlap_steps, an admission round's step is launched ahead as well (the "
                                   "round's prompts beside the running requests' next decode tokens), so the host "
                                   "schedules and launches its eager step while the GPU finishes the step before", True)
    overlap_ending_slots: bool = _doc("with overlap_steps, a step launched ahead that is short of KV slots takes "
                                      "those of the requests ending by length at the step in flight, as the host "
                                      "frees them once its tokens are in, before evicting an adapter or waiting "
                                      "for the step (off only to measure it: on one H100, where the pool binds S2 "
                                      "n = 2000, it cut the steps held back for slots from ~1,300 to ~520 and "
                                      "served 5% more; docs/benchmarks.md, 2026-12-07 22:03)", True)
    direct_launch: bool = _doc("a step's layers after the first launch the Triton kernels (norms, rotary, KV write, "
                               "attention, activation, LoRA shrink and expand) the first layer's calls compiled, "
                               "skipping Triton's per-call argument binding (CUDA; kernels/compiled_launch.py); "
                               "on the H200 it cut an admission step's host launch from 33 to 25 ms but left "
                               "served throughput unchanged (docs/benchmarks.md)", False)
    kv_slot_run: int = _doc("a request's KV slots are taken from the pool this many at a time, so its context "
                            "lies in runs of consecutive slots rather than one slot per decode step among the "
                            "whole batch's; the slots of a run not yet written are the request's until it ends "
                            "(at most kv_slot_run - 1 a request); 1 = one at a time", 1)
    kernel_shapes: str = _doc("launch shapes to try instead of the kernels' own choice, comma-separated: "
                              "attention_block_n=N, attention_stages=N, attention_warps=N, heads_first, split_mixed, "
                              "expand_cols_first; no_heads_first and no_split_mixed turn off those on by default "
                              "(shared/kernel_shapes.py; each gives the same results); empty = the kernels' choice",
                              "")
    cuda_graph_max_batch: int = _doc("largest decode batch replayed from a graph; bigger ones run eagerly", 256)
    cuda_graph_warmup_s: float = _doc("seconds a CUDA worker spends capturing decode graphs (every batch, rank and "
                                      "context bucket up to cuda_graph_max_context) before it reports ready; the "
                                      "rest are captured on first use; 0 = all on first use", 120.0)
    cuda_graph_max_context: int = _doc("longest context whose decode graphs are captured before ready (0 = "
                                       "max_model_len)", 2048)
    cuda_graph_lora_targets: str = _doc("modules the served adapters adapt, comma-separated (e.g. q_proj,k_proj,"
                                        "v_proj,o_proj): warm-up captures decode graphs running those modules' "
                                        "LoRA groups only; a step whose adapters adapt others has its graphs "
                                        "captured at first use; empty = every module", "")
    cuda_graph_few_adapters: int = _doc("decode steps carrying at most this many distinct adapters replay graphs of "
                                        "their own, whose LoRA launches are planned for that many busy segments "
                                        "and share them out among cuda_graph_segment_programs programs (a graph "
                                        "launches a segment per token, most of them empty at a few adapters: "
                                        "S2's decode step at batch 256 with 5 adapters 18.6 ms against 22.4 on an "
                                        "H200, docs/benchmarks.md); 0 = one graph per shape, planned for every "
                                        "segment", 32)
    cuda_graph_segment_programs: int = _doc("programs per column tile that share a few-adapter graph's segments "
                                            "out (see cuda_graph_few_adapters)", 32)
    lora_mode: str = _doc("how adapters are applied: unified (paged pool kernels), bmm (baseline: rows copied to "
                          "buffers padded to the batch's max rank, torch.bmm) or merge (baseline: one adapter per "
                          "batch, merged into the base weights)", "unified")
    adapter_pool_slots: int = _doc("0 = one unified pool; N > 0 = baseline with N slots reserved for adapter rows and "
                                   "the rest for KV, neither using the other's", 0)

    def __post_init__(self) -> None:
        if self.max_resident_adapters == 0:
            self.max_resident_adapters = max(DEFAULT_RESIDENT_ADAPTERS, self.max_running_requests)
        if self.max_resident_adapters < 0:
            raise ValueError(f"max_resident_adapters must be >= 0 (0 = the default), got "
                             f"{self.max_resident_adapters}")
        if self.lora_mode not in LORA_MODES:
            raise ValueError(f"lora_mode must be one of {', '.join(LORA_MODES)}, got {self.lora_mode!r}")
        if isinstance(self.adapter_pool_slots, bool) or not isinstance(self.adapter_pool_slots, int):
            raise ValueError(f"adapter_pool_slots must be an integer, got {self.adapter_pool_slots!r}")
        if self.adapter_pool_slots < 0:
            raise ValueError(f"adapter_pool_slots must be >= 0 (0 = unified pool), got {self.adapter_pool_slots}")
        if self.num_slots and self.adapter_pool_slots >= self.num_slots:
            raise ValueError(f"adapter_pool_slots ({self.adapter_pool_slots}) must leave KV slots: it has to be "
                             f"less than num_slots ({self.num_slots})")
        if not _integer(self.admission_batch, 1):
            raise ValueError(f"admission_batch must be an integer >= 1 (1 = admit at every step), got {self.admission_batch!r}")
        if not _number(self.admission_wait_s) or not self.admission_wait_s >= 0:
            raise ValueError(f"admission_wait_s must be a number of seconds >= 0, got {self.admission_wait_s!r}")
        for name in ("decode_reserve", "decode_reserve_low"):
            value = getattr(self, name)
            if not _number(value) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a share from 0 to 1, got {value!r}")
        if self.decode_reserve and self.decode_reserve_low > self.decode_reserve:
            raise ValueError(f"decode_reserve_low ({self.decode_reserve_low!r}) must not exceed decode_reserve "
                             f"({self.decode_reserve!r})")
        if not _integer(self.decode_margin_steps, 0, 64):
            raise ValueError(f"decode_margin_steps must be an integer from 0 to 64, got {self.decode_margin_steps!r}")
        if not _number(self.decode_reserve_ease_s) or not self.decode_reserve_ease_s >= 0:
            raise ValueError(f"decode_reserve_ease_s must be a number of seconds >= 0, got "
                             f"{self.decode_reserve_ease_s!r}")
        if not _number(self.pool_headroom_gb) or not self.pool_headroom_gb >= 0:
            raise ValueError(f"pool_headroom_gb must be a number of GiB >= 0, got {self.pool_headroom_gb!r}")
        if not _integer(self.kv_slot_run, 1, 256):
            raise ValueError(f"kv_slot_run must be an integer from 1 to 256, got {self.kv_slot_run!r}")
        if not _number(self.pool_memory_fraction) or not 0 < self.pool_memory_fraction < 1:
            # The rest of the free memory holds the decode graphs and a step's activations: at 1 nothing would.
            raise ValueError(f"pool_memory_fraction must be a number between 0 and 1 (exclusive), got "
                             f"{self.pool_memory_fraction!r}")
        if not isinstance(self.kernel_shapes, str):
            raise ValueError(f"kernel_shapes must be a comma-separated string, got {self.kernel_shapes!r}")
        LaunchShapes.parse(self.kernel_shapes)
        unknown = [m for m in self.graph_lora_targets() if m not in MODULES]
        if unknown:
            raise ValueError(f"cuda_graph_lora_targets: unknown module(s) {', '.join(unknown)}; adaptable modules "
                             f"are {', '.join(MODULES)}")
        for name in ("cuda_graph_few_adapters", "cuda_graph_segment_programs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.cuda_graph_few_adapters and not self.cuda_graph_segment_programs:
            raise ValueError("cuda_graph_segment_programs must be > 0 when cuda_graph_few_adapters is set (the "
                             "few-adapter graphs share their segments out among that many programs)")
        if not self.cuda_graph_warmup_s >= 0 or self.cuda_graph_max_context < 0:
            raise ValueError("cuda_graph_warmup_s and cuda_graph_max_context must be >= 0, got "
                             f"{self.cuda_graph_warmup_s!r} and {self.cuda_graph_max_context!r}")

    def graph_lora_targets(self) -> tuple[str, ...]:
        """The modules of cuda_graph_lora_targets (every module when it is empty)."""
        if not isinstance(self.cuda_graph_lora_targets, str):
            raise ValueError(f"cuda_graph_lora_targets must be a comma-separated string of module names, got "
                             f"{self.cuda_graph_lora_targets!r}")
        names = tuple(m.strip() for m in self.cuda_graph_lora_targets.split(",") if m.strip())
        return names or MODULES

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        return from_dict(cls, values)


def from_dict(cls, values: dict):
    """Build a config dataclass, naming any unknown key instead of silently ignoring it."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**values)


def field_docs(cls) -> dict[str, str]:
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def _arg_type(f: dataclasses.Field, default):
    if default is not None:
        return type(default)
    name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
    return {"int": int, "float": float}.get(name.split("|")[0].strip(), str)


def bool_word(text: str) -> bool:
    """A boolean flag's value on a command line."""
    word = text.strip().lower()
    if word in ("true", "yes", "on", "1"):
        return True
    if word in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_config_arguments(parser, cls, skip: tuple[str, ...] = ()) -> None:
    """One `--flag-name` per field of a config dataclass (booleans get --flag / --no-flag)."""
    for f in fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not MISSING else None
        flag = "--" + f.name.replace("_", "-")
        # argparse expands %-formats in help; docs quote percentages.
        help_text = f"{f.metadata.get('doc', '')} (default: {default!r})".replace("%", "%%")
        if isinstance(default, bool):
            # `--flag`, `--no-flag`, or `--flag true|false`: the launcher's `--set SERVICE.FLAG=VALUE` passes a value.
            parser.add_argument(flag, dest=f.name, default=default, nargs="?", const=True, type=bool_word,
                                metavar="true|false", help=help_text)
            parser.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=f"same as {flag} false")
        else:
            parser.add_argument(flag, dest=f.name, type=_arg_type(f, default), default=default, help=help_text)


def config_from_args(cls, argv: list[str] | None, prog: str):
    """Parse a process's command line into its config dataclass; a bad value is a usage error."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_config_arguments(parser, cls)
    try:
        return cls(**vars(parser.parse_args(argv)))
    except ValueError as e:
        parser.error(str(e))
