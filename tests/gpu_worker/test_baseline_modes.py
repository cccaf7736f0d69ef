"""The engine baselines (EngineConfig.lora_mode bmm / merge, adapter_pool_slots > 0) serve exactly what the
unified engine serves: same greedy tokens, same logits, on a workload mixing adapters of ranks 1, 8 and 16
with base-model requests joining at different steps. Each mode also keeps its own promise: bmm's ops match
the reference ops; merge runs one adapter at a time, no LoRA op at all, and gives the base weights back;
no-unify keeps adapter rows and KV in their own slot ranges, evicting and preempting within them."""
from __future__ import annotations

import random

import pytest
import torch

from services.gpu_worker.adapter_layout import pack_adapter
from services.gpu_worker.engine import Engine
from services.gpu_worker.ops import bmm_lora, reference
from services.gpu_worker.pool import UnifiedPool
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.resident_adapters import AdapterTooLarge, ResidentAdapters
from services.gpu_worker.sampling import SamplingParams
from services.gpu_worker.worker_config import parse_args
from shared.adapter_format import load_adapter
from shared.config import EngineConfig
from shared.lora_weights import LoraModuleWeights, LoraWeights
from shared.make_adapters import make_adapters
from shared.model_config import MODULE_INDEX, MODULES, ModelConfig
from shared.tiny_model import make_model
from tests.tp.workload import run as run_workload

MAX_TOKENS = 6
ADAPTERS = [  # (name, rank, target modules)
    ("r1", 1, ["q_proj", "v_proj"]),
    ("r8", 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ("r16", 16, list(MODULES)),
    ("r8-mlp", 8, ["gate_proj", "up_proj", "down_proj"]),
]
QKV = tuple(MODULE_INDEX[m] for m in ("q_proj", "k_proj", "v_proj"))
GATE_UP = (MODULE_INDEX["gate_proj"], MODULE_INDEX["up_proj"])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("baselines")
    base = make_model(root / "model", preset="tiny-gqa", seed=5)
    cfg = ModelConfig.from_dir(base)
    weights = {}
    for i, (name, rank, targets) in enumerate(ADAPTERS):
        folder = make_adapters(root / name, base, 1, ranks=[rank], targets=targets, seed=20 + i, prefix=name)[0]
        weights[name] = load_adapter(folder, cfg, name=name)
    rng = random.Random(3)
    names = [None] + [name for name, _, _ in ADAPTERS]
    workload = []  # (request id, prompt, adapter, step it joins at)
    for i in range(12):
        prompt = [rng.randrange(3, cfg.vocab_size) for _ in range(rng.choice([1, 3, 8, 17, 26]))]
        workload.append((f"req{i}", prompt, names[i % len(names)], i // 4))
    workload.append(("same-base", workload[1][1], None, 0))  # one prompt on the base model and on an adapter
    expected = run_engine(base, weights, workload)[1:]
    return base, cfg, weights, workload, expected


def run_engine(base, weights, workload, on_forward=None, backend: str = "auto", **config):
    engine = Engine.from_model_dir(base, EngineConfig(**{"max_lora_rank": 16, "max_resident_adapters": 4, **config}),
                                   backend=backend)
    if on_forward is not None:
        forward = engine.model.forward

        def watched(batch, pool):
            on_forward(engine)
            return forward(batch, pool)

        engine.model.forward = watched
    tokens, logits = run_workload(engine, weights, workload, MAX_TOKENS)
    assert not engine.has_unfinished(), "engine did not finish"
    return engine, tokens, logits


def assert_same_outputs(expected, tokens, logits, tol: float = 1e-4):
    ref_tokens, ref_logits = expected
    assert tokens == ref_tokens
    for rid, ref in ref_logits.items():
        assert len(logits[rid]) == len(ref) == MAX_TOKENS
        for step, (ours, theirs) in enumerate(zip(logits[rid], ref)):
            diff = (ours - theirs).abs().max().item()
            assert diff < tol, f"{rid} step {step}: logits differ by {diff:.2e}"


def test_the_adapters_change_what_the_model_says(setup):
    """Without this the comparisons below could pass with every adapter ignored."""
    _, _, _, _, (_, logits) = setup
    assert (logits["req1"][0] - logits["same-base"][0]).abs().max().item() > 1e-2


# ---- bmm ---------------------------------------------------------------------------------------------

def test_bmm_mode_matches_unified(setup, monkeypatch):
    base, _, weights, workload, expected = setup
    calls = []
    real_shrink = bmm_lora.lora_shrink
    monkeypatch.setattr(bmm_lora, "lora_shrink", lambda *a, **k: calls.append(a[5]) or real_shrink(*a, **k))
    engine, tokens, logits = run_engine(base, weights, workload, lora_mode="bmm")
    assert_same_outputs(expected, tokens, logits)
    assert engine.ops.lora_shrink is not reference.lora_shrink and not hasattr(engine.ops, "prepare_lora")
    assert calls and max(calls) == 16, "the bmm ops ran, padded to the batch's max rank"


def test_bmm_mode_on_the_triton_backend_matches_unified(setup):
    """Triton attention and norms (the interpreter without a GPU) with the bmm LoRA ops."""
    base, _, weights, workload, _ = setup
    small = [(rid, prompt[:9], adapter, 0) for rid, prompt, adapter, _ in workload[1:4]] + [workload[0][:3] + (1,)]
    _, ref_tokens, ref_logits = run_engine(base, weights, small, num_slots=512)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, tokens, logits = run_engine(base, weights, small, backend="triton", lora_mode="bmm", num_slots=512,
                                   device=device)
    assert_same_outputs((ref_tokens, ref_logits), tokens, {r: [x.cpu() for x in v] for r, v in logits.items()})


class AdapterPool:
    """A one-layer pool holding four adapters (ranks 1, 8, 16 and one with unadapted modules) at shuffled
    slots, every other slot filled with garbage, loaded by the engine's own residency code."""

    def __init__(self, dtype: torch.dtype, seed: int):
        self.cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=40, intermediate_size=56, num_layers=1,
                               num_heads=4, num_kv_heads=2, head_dim=10)  # slot width 20: rows straddle slots
        gen = torch.Generator().manual_seed(seed)
        ranks = [{"q_proj": 1, "v_proj": 1, "down_proj": 1}, {m: 8 for m in MODULES},
                 {m: 16 for m in MODULES}, {"k_proj": 3, "up_proj": 5}]
        packed = {}
        for i, module_ranks in enumerate(ranks):
            modules = {}
            for m, r in module_ranks.items():
                fan_in, fan_out = self.cfg.module_dims(m)
                modules[m] = [LoraModuleWeights(torch.randn(r, fan_in, generator=gen) / fan_in ** 0.5,
                                                torch.randn(fan_out, r, generator=gen), scale=0.5)]
            packed[f"a{i}"] = pack_adapter(LoraWeights(f"a{i}", 1, modules), self.cfg, self.cfg.kv_dim, dtype)
        self.pool = UnifiedPool(1, 600, self.cfg.kv_dim, dtype, "cpu")
        taken = self.pool.allocator.allocate(600)
        random.Random(seed).shuffle(taken)
        self.pool.allocator.free(taken)
        self.pool.kv.normal_(generator=gen)
        self.adapters = ResidentAdapters(self.pool, self.cfg, 6, 16, packed.__getitem__)
        self.ids = [self.adapters.acquire(name).resident_id for name in packed]
        self.gen = gen

    def token_adapter(self, num_tokens: int) -> torch.Tensor:
        ids = torch.tensor([-1] + self.ids, dtype=torch.int32)
        picks = torch.randint(0, len(ids), (num_tokens,), generator=self.gen)
        picks[: len(ids)] = torch.arange(len(ids))
        return ids[picks].contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [7, 40])
def test_bmm_ops_match_the_reference_ops(dtype, num_tokens, monkeypatch):
    ap = AdapterPool(dtype, seed=num_tokens)
    cfg, tables, pool = ap.cfg, ap.adapters.tables, ap.pool
    if num_tokens == 40:
        monkeypatch.setattr(bmm_lora, "GATHER_ELEMENTS", 3000)  # several token chunks per module
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    token_adapter = ap.token_adapter(num_tokens)
    for modules, out_dims, fan_in in [(QKV, (cfg.q_dim, cfg.kv_dim, cfg.kv_dim), cfg.hidden_size),
                                      (GATE_UP, (cfg.intermediate_size,) * 2, cfg.hidden_size),
                                      ((MODULE_INDEX["down_proj"],), (cfg.hidden_size,), cfg.intermediate_size)]:
        for max_rank in (16, 24):  # the batch's max rank, and a larger graph rank bucket
            x = torch.randn(num_tokens, fan_in, generator=ap.gen).to(dtype)
            ref_y = reference.lora_shrink(x, pool.k(0), token_adapter, tables, modules, max_rank)
            y = bmm_lora.lora_shrink(x, pool.k(0), token_adapter, tables, modules, max_rank)
            assert y.shape == ref_y.shape and y.dtype == dtype
            assert torch.equal(y[ref_y == 0], ref_y[ref_y == 0]), "zeros past each rank and for base-only tokens"
            assert (y.double() - ref_y.double()).norm() <= tol * ref_y.double().norm()
            start = torch.randn(num_tokens, sum(out_dims), generator=ap.gen).to(dtype)
            ref_out, out = start.clone(), start.clone()
            reference.lora_expand(ref_y, pool.v(0), token_adapter, tables, modules, ref_out, out_dims)
            bmm_lora.lora_expand(ref_y, pool.v(0), token_adapter, tables, modules, out, out_dims)
            base_only = token_adapter < 0
            assert torch.equal(out[base_only], start[base_only]), "base-only tokens are left untouched"
            assert (out - ref_out).double().norm() <= tol * (ref_out - start).double().norm()


# ---- merge -------------------------------------------------------------------------------------------

def test_merge_mode_matches_unified_running_one_adapter_at_a_time(setup, monkeypatch):
    base, _, weights, workload, expected = setup
    lora_calls = []
    for op in ("lora_shrink", "lora_expand"):
        real = getattr(reference, op)
        monkeypatch.setattr(reference, op, lambda *a, _real=real, **k: lora_calls.append(1) or _real(*a, **k))
    batches = []

    def one_adapter(engine):
        adapters = {s.req.adapter for s in engine.running}
        assert adapters <= {engine.merge.current}, f"batch {adapters} while {engine.merge.current!r} is merged"
        batches.append(engine.merge.current)

    engine, tokens, logits = run_engine(base, weights, workload, on_forward=one_adapter, lora_mode="merge")
    assert_same_outputs(expected, tokens, logits)
    assert not lora_calls, "merged adapters run as base-model requests: no LoRA op"
    assert set(batches) == {None, "r1", "r8", "r16", "r8-mlp"} and engine.merge.merges >= 4
    run_engine(base, weights, workload[:3])
    assert lora_calls, "the unified engine does call the LoRA ops these counters watch"


def test_merge_switches_to_the_oldest_waiting_request_once_the_batch_drains(setup):
    base, _, weights, _, _ = setup
    order = [("a1", "r8"), ("b1", "r16"), ("a2", "r8"), ("base", None), ("b2", "r16"), ("b3", "r16")]
    workload = [(rid, [5, 6, 7 + i], adapter, 0) for i, (rid, adapter) in enumerate(order)]
    seen = []

    def record(engine):
        if not seen or seen[-1] != engine.merge.current:
            seen.append(engine.merge.current)

    run_engine(base, weights, workload, on_forward=record, lora_mode="merge")
    # The oldest request's adapter takes every waiting request of it: a2 joins a1's batch ahead of b1, then b1,
    # b2 and b3 share one batch, then the base-model request runs.
    assert seen == ["r8", "r16", None]


def merge_engine(setup):
    """A merge-mode engine with r8 and r16 registered, and sampling parameters for its requests."""
    base, _, weights, _, _ = setup
    engine = Engine.from_model_dir(base, EngineConfig(max_lora_rank=16, max_resident_adapters=4, lora_mode="merge"))
    for name in ("r8", "r16"):
        engine.register_adapter(name, weights[name])
    return engine, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def test_merge_takes_only_the_requests_waiting_when_its_batch_began(setup):
    """A request of the merged adapter that arrives while its batch runs waits for the next turn: a steady
    stream of one adapter never holds back an older request of another."""
    engine, params = merge_engine(setup)
    engine.add_request(EngineRequest("a1", [5, 6, 7], params, adapter="r8"))
    engine.add_request(EngineRequest("b1", [5, 6, 8], params, adapter="r16"))
    engine.step()  # a1's batch begins; b1 is older than anything that arrives now
    assert engine.merge.current == "r8" and {s.req.request_id for s in engine.running} == {"a1"}
    engine.add_request(EngineRequest("a2", [5, 6, 9], params, adapter="r8"))
    order = []
    while engine.has_unfinished():
        engine.step()
        for s in engine.running:
            if s.req.request_id not in order:
                order.append(s.req.request_id)
    assert order.index("b1") < order.index("a2"), order


def test_merge_takes_its_whole_group_however_deep_in_the_queue(setup):
    """Every waiting request of the merged adapter joins its batch, even behind more requests of other
    adapters than the admission scan passes over for loads in flight (ADMISSION_SCAN)."""
    from services.gpu_worker.engine import ADMISSION_SCAN

    engine, params = merge_engine(setup)
    engine.add_request(EngineRequest("a0", [5, 6, 7], params, adapter="r8"))
    for k in range(ADMISSION_SCAN + 4):
        engine.add_request(EngineRequest(f"b{k}", [5, 6, 8], params, adapter="r16"))
    engine.add_request(EngineRequest("a1", [5, 6, 9], params, adapter="r8"))
    engine.step()
    assert engine.merge.current == "r8"
    assert {s.req.request_id for s in engine.running} == {"a0", "a1"}
    assert len(engine.waiting) == ADMISSION_SCAN + 4


def test_unmerge_restores_the_base_weights(setup):
    base, cfg, weights, workload, _ = setup
    engine = Engine.from_model_dir(base, EngineConfig(max_lora_rank=16, max_resident_adapters=4, lora_mode="merge"))
    for name, w in weights.items():
        engine.register_adapter(name, w)
    layers = engine.model.w.layers
    before = [{k: getattr(lw, k).clone() for k in ("qkv", "o", "gate_up", "down")} for lw in layers]
    engine.merge.merge("r16")
    for layer, lw in enumerate(layers):  # W + s·B·A, from the adapter's own tensors rather than the pool rows
        for m, (weight, row0) in {"q_proj": ("qkv", 0), "v_proj": ("qkv", cfg.q_dim + cfg.kv_dim),
                                  "o_proj": ("o", 0), "up_proj": ("gate_up", cfg.intermediate_size),
                                  "down_proj": ("down", 0)}.items():
            w = weights["r16"].modules[m][layer]
            expected = before[layer][weight][row0: row0 + w.lora_b.shape[0]] + w.scale * (w.lora_b @ w.lora_a)
            torch.testing.assert_close(getattr(lw, weight)[row0: row0 + w.lora_b.shape[0]], expected,
                                       atol=1e-6, rtol=1e-5)
    engine.merge.unmerge()
    engine.merge.merge("r1")
    engine.merge.unmerge()
    for name in ("r8", "r8-mlp", "r16", "r1"):  # and through the engine, switching as requests ask
        engine.add_request(EngineRequest(name, [4, 5, 6], SamplingParams(max_tokens=2, ignore_eos=True), name))
    while engine.has_unfinished():
        engine.step()
    assert engine.merge.merges == 6
    engine.merge.unmerge()
    assert engine.merge.current is None and engine.adapters.slots_in_use == engine.adapters.unused_slots
    for lw, saved in zip(layers, before):
        for k, t in saved.items():
            torch.testing.assert_close(getattr(lw, k), t, atol=1e-6, rtol=0)


def test_merge_fails_a_request_whose_adapter_cannot_load_and_serves_the_rest(setup):
    base, _, weights, _, _ = setup
    engine = Engine.from_model_dir(base, EngineConfig(max_lora_rank=16, lora_mode="merge"))
    engine.register_adapter("r8", weights["r8"])
    for rid, adapter in [("gone", "missing"), ("ok", "r8"), ("base", None)]:
        engine.add_request(EngineRequest(rid, [3, 4], SamplingParams(max_tokens=2, ignore_eos=True), adapter))
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (out.finish_reason, out.error)
    assert results["gone"][0] == "error" and "'missing'" in results["gone"][1]
    assert results["ok"] == ("length", None) and results["base"] == ("length", None)


# ---- no-unify ------------------------------------------------------------------------------------------

def test_no_unify_matches_unified_in_tight_pools_that_force_eviction_and_preemption(setup):
    base, cfg, weights, workload, expected = setup
    sizes = {name: pack_adapter(w, cfg, cfg.kv_dim).n_slots for name, w in weights.items()}
    reserved = max(sizes.values()) + min(sizes.values())  # the largest adapter and one small one at most
    kv = 48
    checks = []

    def ranges_kept(engine):
        split = engine.pool.adapter_slots
        for name in engine.adapters.names:
            assert all(s < split for s in engine.adapters._by_name[name].slots), f"{name} outside the adapter range"
        kv_held = [s for seq in engine.running for s in seq.slots]
        assert all(s >= split for s in kv_held), "KV in the adapter range"
        cap = engine.capacity()
        assert cap["total_slots"] == reserved + kv
        assert cap["adapter_slots"] == engine.adapters.slots_in_use <= reserved
        assert cap["kv_slots"] == len(kv_held) and cap["free_slots"] == reserved + kv - cap["adapter_slots"] - len(kv_held)
        checks.append(1)

    engine, tokens, logits = run_engine(base, weights, workload, on_forward=ranges_kept, num_slots=reserved + kv,
                                        adapter_pool_slots=reserved)
    assert_same_outputs(expected, tokens, logits)
    assert checks and engine.num_preemptions > 0 and engine.adapters.loads > len(weights)


def test_no_unify_kv_shortage_never_evicts_adapters_and_adapters_never_take_kv():
    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=8)
    gen = torch.Generator().manual_seed(0)

    def adapter(name: str, rank: int):
        a = LoraModuleWeights(torch.randn(rank, 16, generator=gen), torch.randn(16, rank, generator=gen), 1.0)
        return pack_adapter(LoraWeights(name, 1, {"q_proj": [a]}), cfg, cfg.kv_dim)

    packed = {"small": adapter("small", 2), "big": adapter("big", 6), "huge": adapter("huge", 12)}
    assert (packed["small"].n_slots, packed["big"].n_slots, packed["huge"].n_slots) == (2, 6, 12)
    pool = UnifiedPool(1, 20, cfg.kv_dim, torch.float32, "cpu", adapter_slots=8)
    adapters = ResidentAdapters(pool, cfg, 4, 16, packed.__getitem__)
    assert pool.allocator.allocate(3) == [8, 9, 10]
    small = adapters.acquire("small")
    assert small.slots == [0, 1]
    adapters.release("small")  # unused: evictable, but only for adapters
    assert not adapters.evict_until(13) and "small" in adapters, "KV shortage cannot be helped by adapters"
    assert adapters.evict_until(9)
    assert adapters.can_make_room(9 + adapters.slots_to_load("big"), keep="big")
    assert not adapters.can_make_room(10 + adapters.slots_to_load("big"), keep="big")
    big = adapters.acquire("big")  # needs all but 2 adapter slots: fits beside small
    assert all(s < 8 for s in big.slots) and "small" in adapters
    adapters.release("big")
    with pytest.raises(AdapterTooLarge, match="adapter pool has 8"):
        adapters.slots_to_load("huge")
    pool.allocator.free([8, 9, 10])
    assert pool.num_free == 20 - 8 and pool.num_used == 8
    with pytest.raises(RuntimeError, match="freed while not in use"):
        pool.allocator.free([0])  # an adapter slot is no KV slot


# ---- config ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values, problem", [
    ({"lora_mode": "padded"}, "lora_mode must be one of unified, bmm, merge"),
    ({"adapter_pool_slots": -1}, "adapter_pool_slots must be >= 0"),
    ({"num_slots": 100, "adapter_pool_slots": 100}, "less than num_slots"),
    ({"adapter_pool_slots": 2.5}, "adapter_pool_slots must be an integer"),
])
def test_bad_baseline_settings_are_refused(values, problem, capsys):
    with pytest.raises(ValueError, match=problem):
        EngineConfig.from_dict(values)
    argv = ["--dummy-weights", "x"] + [a for k, v in values.items() for a in ("--" + k.replace("_", "-"), str(v))]
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert problem in err or "invalid int value" in err


def test_a_split_pool_must_leave_kv_slots():
    with pytest.raises(ValueError, match=r"adapter_slots \(8\) must be >= 0 and leave KV slots"):
        UnifiedPool(1, 8, 4, torch.float32, "cpu", adapter_slots=8)
    worker, engine = parse_args(["--dummy-weights", "x", "--lora-mode", "bmm", "--adapter-pool-slots", "64"])
    assert (engine.lora_mode, engine.adapter_pool_slots) == ("bmm", 64)
