"""PEFT adapter IO: what loads, with which ranks and scales (checked against peft itself), and every way a
bad adapter is refused with a message naming the problem."""
from __future__ import annotations

import json
import math
import os
import pickle
import struct

import pytest
import torch
from safetensors.torch import save as st_save
from safetensors.torch import save_file

from shared.adapter_format import AdapterError, load_adapter, load_adapter_bytes, save_adapter, tensor_key
from shared.lora_weights import LoraModuleWeights, LoraWeights
from shared.model_config import MODULES, ModelConfig


@pytest.fixture(scope="module")
def cfg(tiny_model_dir) -> ModelConfig:
    return ModelConfig.from_dir(tiny_model_dir)


def valid_adapter(cfg: ModelConfig, r: int = 4, targets=("q_proj", "v_proj"), seed: int = 0) -> tuple[dict, dict]:
    """An adapter_config dict and its tensors, small and correct; tests break one thing at a time."""
    g = torch.Generator().manual_seed(seed)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": list(targets), "bias": "none",
              "modules_to_save": None, "use_dora": False}
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in targets:
            fan_in, fan_out = cfg.module_dims(m)
            tensors[tensor_key(layer, m, "A")] = torch.randn(r, fan_in, generator=g)
            tensors[tensor_key(layer, m, "B")] = torch.randn(fan_out, r, generator=g)
    return config, tensors


def load(config, tensors, cfg, **kw):
    return load_adapter_bytes(json.dumps(config).encode(), st_save(tensors), cfg, **kw)


def write_folder(path, config, tensors):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


# ------------------------------------------------------------------ what loads

def test_valid_adapter_loads_tensors_ranks_and_scale(cfg):
    config, tensors = valid_adapter(cfg, r=4)
    w = load(config, tensors, cfg, name="a1")
    assert w.name == "a1" and w.num_layers == cfg.num_layers
    assert set(w.modules) == {"q_proj", "v_proj"}
    assert w.module_rank("q_proj") == 4 and w.module_rank("k_proj") == 0 and w.max_rank == 4
    for layer in range(cfg.num_layers):
        got = w.modules["v_proj"][layer]
        assert torch.equal(got.lora_a, tensors[tensor_key(layer, "v_proj", "A")])
        assert torch.equal(got.lora_b, tensors[tensor_key(layer, "v_proj", "B")])
        assert got.scale == 8 / 4


def test_keys_with_default_adapter_name_are_tolerated(cfg):
    config, tensors = valid_adapter(cfg)
    renamed = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    w = load(config, renamed, cfg)
    assert torch.equal(w.modules["q_proj"][1].lora_a, tensors[tensor_key(1, "q_proj", "A")])


def test_folder_name_is_the_default_adapter_name(cfg, tmp_path):
    folder = write_folder(tmp_path / "my-style", *valid_adapter(cfg))
    assert load_adapter(folder, cfg).name == "my-style"
    assert load_adapter(folder, cfg, name="other").name == "other"


def test_safetensors_is_used_and_a_pickle_beside_it_is_ignored(cfg, tmp_path):
    folder = write_folder(tmp_path / "both", *valid_adapter(cfg))
    (folder / "adapter_model.bin").write_bytes(b"not read")
    assert load_adapter(folder, cfg).module_rank("q_proj") == 4


def test_regex_target_modules_and_layers_to_transform(cfg):
    config, tensors = valid_adapter(cfg, targets=("q_proj", "down_proj"))
    config["target_modules"] = r"model\.layers\.\d+\.(self_attn\.q_proj|mlp\.down_proj)"
    w = load(config, tensors, cfg)
    assert set(w.modules) == {"q_proj", "down_proj"}

    config, tensors = valid_adapter(cfg, targets=("k_proj",))
    config["layers_to_transform"] = [1]
    tensors = {k: v for k, v in tensors.items() if ".layers.1." in k}
    w = load(config, tensors, cfg)
    assert w.modules["k_proj"][0] is None and w.modules["k_proj"][1].rank == 4


def test_all_linear_and_peft_default_targets(cfg):
    config, tensors = valid_adapter(cfg, targets=MODULES)
    config["target_modules"] = "all-linear"
    assert set(load(config, tensors, cfg).modules) == set(MODULES)
    # target_modules null: PEFT's default for the Llama family, q_proj and v_proj.
    config, tensors = valid_adapter(cfg, targets=("q_proj", "v_proj"))
    config["target_modules"] = None
    assert set(load(config, tensors, cfg).modules) == {"q_proj", "v_proj"}


def peft_adapter(base_dir, out_dir, seed, **lora_kwargs):
    """An adapter made and saved by peft itself, with random nonzero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(init_lora_weights=False, **lora_kwargs))
    model.save_pretrained(out_dir)
    return out_dir


def peft_modules(base_dir, adapter_dir):
    """{(layer, module): (rank, scaling, A, B)} as peft sees the adapter once loaded."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter_dir))
    found = {}
    for i, layer in enumerate(model.base_model.model.model.layers):
        for m in MODULES:
            block = layer.self_attn if hasattr(layer.self_attn, m) else layer.mlp
            mod = getattr(block, m)
            if hasattr(mod, "lora_A") and "default" in mod.lora_A:
                found[(i, m)] = (mod.r["default"], mod.scaling["default"], mod.lora_A["default"].weight.detach(),
                                 mod.lora_B["default"].weight.detach())
    return found


PEFT_CASES = {
    "patterns-rslora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                            # "proj" and "self_attn" match no full name under peft's rule (they are not a
                            # dotted suffix); a loader that merely searched for them would get ranks wrong.
                            rank_pattern={"down_proj": 12, "model.layers.0.self_attn.q_proj": 3, "proj": 2},
                            alpha_pattern={"up_proj": 5, r"layers\.1\.self_attn\.v_proj": 7, "self_attn": 99},
                            use_rslora=True),
    "layers-subset": dict(r=6, lora_alpha=3, target_modules=["k_proj", "o_proj", "gate_proj"], layers_to_transform=[1]),
    "regex-targets": dict(r=2, lora_alpha=4, target_modules=r".*\.(q_proj|k_proj|v_proj|o_proj)",
                          exclude_modules=["model.layers.0.self_attn.k_proj"]),
}


@pytest.mark.parametrize("case", PEFT_CASES)
def test_ranks_and_scales_match_peft(case, cfg, tiny_model_dir, tmp_path):
    folder = peft_adapter(tiny_model_dir, tmp_path / case, seed=1, **PEFT_CASES[case])
    expected = peft_modules(tiny_model_dir, folder)
    w = load_adapter(folder, cfg)
    got = {(i, m): mw for m, layers in w.modules.items() for i, mw in enumerate(layers) if mw is not None}
    assert set(got) == set(expected)
    for key, (rank, scaling, a, b) in expected.items():
        assert got[key].rank == rank, key
        assert got[key].scale == pytest.approx(scaling, rel=1e-12), key
        assert torch.equal(got[key].lora_a, a) and torch.equal(got[key].lora_b, b), key
    if case == "patterns-rslora":  # the pattern rules themselves, spelled out
        assert got[(0, "q_proj")].rank == 3 and got[(1, "q_proj")].rank == 8 and got[(0, "down_proj")].rank == 12
        assert got[(0, "up_proj")].scale == pytest.approx(5 / math.sqrt(8))
        assert got[(1, "v_proj")].scale == pytest.approx(7 / math.sqrt(8))
        assert got[(0, "v_proj")].scale == pytest.approx(16 / math.sqrt(8))


# ------------------------------------------------------------------ save_adapter

def mixed_weights(cfg: ModelConfig, uniform_layers: bool) -> LoraWeights:
    g = torch.Generator().manual_seed(5)

    def mw(m, r, scale):
        fan_in, fan_out = cfg.module_dims(m)
        return LoraModuleWeights(torch.randn(r, fan_in, generator=g), torch.randn(fan_out, r, generator=g), scale)

    modules = {
        "q_proj": [mw("q_proj", 8, 2.0), mw("q_proj", 3, 0.5)],  # per-layer rank and scale
        "v_proj": [mw("v_proj", 8, 2.0), mw("v_proj", 8, 2.0)],
        "down_proj": [mw("down_proj", 5, 0.75), mw("down_proj", 5, 0.75)],  # per-module rank and scale
    }
    if not uniform_layers:
        modules["gate_proj"] = [None, mw("gate_proj", 8, 2.0)]  # adapted in layer 1 only
    return LoraWeights("mixed", cfg.num_layers, modules)


@pytest.mark.parametrize("uniform_layers", [True, False], ids=["list-targets", "regex-targets"])
def test_save_adapter_round_trips_and_peft_loads_it_as_is(uniform_layers, cfg, tiny_model_dir, tmp_path):
    weights = mixed_weights(cfg, uniform_layers)
    folder = save_adapter(weights, tmp_path / "saved", str(tiny_model_dir), lora_alpha=16)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert isinstance(config["target_modules"], list if uniform_layers else str)

    back = load_adapter(folder, cfg)
    expected = peft_modules(tiny_model_dir, folder)
    for m, layers in weights.modules.items():
        for i, w in enumerate(layers):
            if w is None:
                assert back.modules[m][i] is None and (i, m) not in expected
                continue
            got = back.modules[m][i]
            assert (got.rank, torch.equal(got.lora_a, w.lora_a), torch.equal(got.lora_b, w.lora_b)) == (w.rank, True, True)
            assert got.scale == pytest.approx(w.scale, rel=1e-12)
            rank, scaling, a, b = expected[(i, m)]
            assert rank == w.rank and scaling == pytest.approx(w.scale, rel=1e-12)
            assert torch.equal(a, w.lora_a) and torch.equal(b, w.lora_b)
    assert len(expected) == sum(w is not None for layers in weights.modules.values() for w in layers)


def test_save_adapter_with_rslora_keeps_scales(cfg, tmp_path):
    weights = mixed_weights(cfg, uniform_layers=True)
    back = load_adapter(save_adapter(weights, tmp_path / "rs", "base", use_rslora=True), cfg)
    for m, layers in weights.modules.items():
        for i, w in enumerate(layers):
            assert back.modules[m][i].scale == pytest.approx(w.scale, rel=1e-12)


# ------------------------------------------------------------------ what is refused, and how it is said

def _set(field, value):
    def mutate(config, tensors):
        config[field] = value
    return mutate


def _tensor(key, fn):
    def mutate(config, tensors):
        tensors[key] = fn(tensors[key])
    return mutate


def _drop(key):
    def mutate(config, tensors):
        del tensors[key]
    return mutate


def _add(key, value):
    def mutate(config, tensors):
        tensors[key] = value
    return mutate


QA, QB = tensor_key(0, "q_proj", "A"), tensor_key(0, "q_proj", "B")
VB1 = tensor_key(1, "v_proj", "B")


def _nan(t):
    t = t.clone()
    t[0, 0] = float("nan")
    return t


def _inf(t):
    t = t.clone()
    t[-1, -1] = float("inf")
    return t


REFUSALS = {
    "dora": (_set("use_dora", True), r"DoRA \(use_dora\)"),
    "modules_to_save": (_set("modules_to_save", ["lm_head"]), r"modules_to_save \['lm_head'\] is not supported"),
    "bias": (_set("bias", "lora_only"), r"bias 'lora_only' is not supported"),
    "lora_bias": (_set("lora_bias", True), r"lora_bias"),
    "unknown target lm_head": (_set("target_modules", ["q_proj", "lm_head"]), r"unknown target module 'lm_head'"),
    "unknown target embed_tokens": (_set("target_modules", ["embed_tokens", "q_proj"]), r"unknown target module 'embed_tokens'"),
    "regex target hits embeddings": (_set("target_modules", r".*(q_proj|v_proj|embed_tokens)"),
                                     r"matches unknown target module 'model.embed_tokens'"),
    "peft_type": (_set("peft_type", "PREFIX_TUNING"), r"peft_type 'PREFIX_TUNING' is not supported"),
    "no peft_type": (lambda c, t: c.pop("peft_type"), r"has no peft_type"),
    "r not an integer": (_set("r", "4"), r"r must be a positive integer, got '4'"),
    "alpha not a number": (_set("lora_alpha", None), r"lora_alpha must be a finite number"),
    "bad rank_pattern": (_set("rank_pattern", {"q_proj": 0}), r"rank_pattern\['q_proj'\] must be a positive integer"),
    "A wrong in_features": (_tensor(QA, lambda t: torch.zeros(4, 65)),
                            rf"shape mismatch: '{QA}' is \[4, 65\], expected \[4, 64\]"),
    "B wrong out_features": (_tensor(VB1, lambda t: torch.zeros(32, 4)),
                             rf"shape mismatch: '{VB1}' is \[32, 4\], expected \[64, 4\]"),
    "A/B rank disagree": (_tensor(QB, lambda t: torch.zeros(64, 5)), r"rank mismatch in model.layers.0.self_attn.q_proj: .* rank 4 .* rank 5"),
    "rank differs from r": (_set("r", 8), r"tensors have rank 4 but adapter_config.json says 8 \(r\)"),
    "rank differs from rank_pattern": (_set("rank_pattern", {"v_proj": 2}),
                                       r"model.layers.0.self_attn.v_proj: tensors have rank 4 .* says 2 \(rank_pattern\['v_proj'\]\)"),
    "tensor layer out of range": (_add(tensor_key(2, "q_proj", "A"), torch.zeros(4, 64)), r"layer index 2 out of range"),
    "layers_to_transform out of range": (_set("layers_to_transform", [0, 7]), r"layers_to_transform has layer index 7 out of range"),
    "NaN": (_tensor(QA, _nan), rf"tensor '{QA}' has non-finite values"),
    "Inf": (_tensor(VB1, _inf), rf"tensor '{VB1}' has non-finite values"),
    "integer tensor": (_tensor(QA, lambda t: t.to(torch.int32)), rf"tensor '{QA}' has dtype torch.int32"),
    "missing B": (_drop(QB), r"missing lora_B for model.layers.0.self_attn.q_proj"),
    "missing A": (_drop(QA), r"missing lora_A for model.layers.0.self_attn.q_proj"),
    "missing pair": (lambda c, t: [t.pop(QA), t.pop(QB)], r"no lora_A/lora_B for model.layers.0.self_attn.q_proj"),
    "unexpected key": (_add("base_model.model.model.norm.weight", torch.ones(64)),
                       r"unexpected tensor key 'base_model.model.model.norm.weight'"),
    "untargeted module": (_add(tensor_key(0, "k_proj", "A"), torch.zeros(4, 64)),
                          r"model.layers.0.self_attn.k_proj is not targeted by adapter_config.json"),
    "lora on lm_head": (_add("base_model.model.lm_head.lora_A.weight", torch.zeros(4, 64)), r"unknown target module 'lm_head'"),
    "module in wrong block": (_add("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", torch.zeros(4, 64)),
                              r"q_proj lives in self_attn, not mlp"),
    "duplicate matrix": (lambda c, t: t.__setitem__(QA.replace(".weight", ".default.weight"), t[QA].clone()), r"are the same lora_A matrix"),
    "empty safetensors": (lambda c, t: t.clear(), r"holds no tensors"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refused_with_a_message_naming_the_problem(case, cfg):
    mutate, message = REFUSALS[case]
    config, tensors = valid_adapter(cfg)
    mutate(config, tensors)
    with pytest.raises(AdapterError, match=message):
        load(config, tensors, cfg)


def test_rank_over_max_rank(cfg):
    config, tensors = valid_adapter(cfg, r=16)
    assert load(config, tensors, cfg, max_rank=16).max_rank == 16
    with pytest.raises(AdapterError, match=r"rank 16 of model.layers.0.self_attn.q_proj \(r\) is over the server's max rank 8"):
        load(config, tensors, cfg, max_rank=8)


def test_a_valid_adapter_for_another_base_is_refused(cfg, tiny_gqa_model_dir):
    """tiny-gqa has half the KV width: a k_proj adapter of the MHA model does not fit it."""
    config, tensors = valid_adapter(cfg, targets=("k_proj",))
    with pytest.raises(AdapterError, match=r"expected \[32, 4\]"):
        load(config, tensors, ModelConfig.from_dir(tiny_gqa_model_dir))


@pytest.mark.parametrize("raw, message", [
    (b"{not json", r"adapter_config.json is not valid JSON"),
    (b"\xff\xfe", r"adapter_config.json is not valid JSON"),
    (b"[1, 2]", r"must hold a JSON object, got list"),
])
def test_malformed_config_json(raw, message, cfg):
    _, tensors = valid_adapter(cfg)
    with pytest.raises(AdapterError, match=message):
        load_adapter_bytes(raw, st_save(tensors), cfg)


def _lying_header(cfg) -> bytes:
    """A well-formed header that claims more data than the file holds."""
    config, tensors = valid_adapter(cfg)
    data = st_save(tensors)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    key = sorted(k for k in header if k != "__metadata__")[0]
    header[key]["data_offsets"][1] += 1 << 20
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data[8 + n:]


@pytest.mark.parametrize("kind", ["garbage", "truncated", "huge header length", "lying offsets", "pickle bytes"])
def test_malformed_safetensors(kind, cfg):
    config, tensors = valid_adapter(cfg)
    good = st_save(tensors)
    data = {
        "garbage": b"this is not a safetensors file at all",
        "truncated": good[: len(good) // 2],
        "huge header length": struct.pack("<Q", 1 << 40) + good[8:],
        "lying offsets": _lying_header(cfg),
        "pickle bytes": pickle.dumps({"x": 1}),
    }[kind]
    with pytest.raises(AdapterError, match=r"adapter_model.safetensors is not a valid safetensors file"):
        load_adapter_bytes(json.dumps(config).encode(), data, cfg)


# ------------------------------------------------------------------ folders

@pytest.mark.timeout(30)
def test_pickle_weights_are_refused_without_being_opened(cfg, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(valid_adapter(cfg)[0]))
    # A FIFO blocks whoever opens it for reading: if the loader opened the pickle, this test would hang.
    os.mkfifo(folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"adapter_model.bin .* is a pickle and is refused"):
        load_adapter(folder, cfg)


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_missing_files(missing, cfg, tmp_path):
    folder = write_folder(tmp_path / "a", *valid_adapter(cfg))
    (folder / missing).unlink()
    with pytest.raises(AdapterError, match=rf"missing file {missing} in adapter folder"):
        load_adapter(folder, cfg)


def test_missing_folder(cfg, tmp_path):
    with pytest.raises(AdapterError, match=r"does not exist"):
        load_adapter(tmp_path / "nowhere", cfg)


def test_adapter_error_is_a_value_error():
    assert issubclass(AdapterError, ValueError)
