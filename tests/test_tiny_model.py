"""The tiny checkpoints and random adapters load in the reference stack (transformers, peft) as they are,
and behave like a model and adapters: greedy output depends on the prompt and on the adapter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors.torch import load_file

from shared.adapter_format import load_adapter
from shared.make_adapters import make_adapters
from shared.model_config import ModelConfig
from shared.tiny_model import BOS_ID, EOS_ID, PAD_ID, UNK_ID, make_model

PROMPTS = ["Hello world", "The river runs through the valley", "What is the capital of France?", "7 + 8 ="]
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "  Name a colour. "}]


@pytest.fixture(params=["tiny", "tiny-gqa"])
def preset(request):
    return request.param


@pytest.fixture
def model_dir(preset, tiny_model_dir, tiny_gqa_model_dir):
    return {"tiny": tiny_model_dir, "tiny-gqa": tiny_gqa_model_dir}[preset]


def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def greedy(model, ids: list[int], steps: int = 8) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=PAD_ID)
    return out[0, len(ids):].tolist()


def test_checkpoint_files_and_geometry(preset, model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    cfg = ModelConfig.from_dir(model_dir)
    gqa = preset == "tiny-gqa"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.intermediate_size) == (64, 2, 4, 16, 176)
    assert cfg.num_kv_heads == (2 if gqa else 4)
    if gqa:
        assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    else:
        assert cfg.rope_scaling is None
    assert cfg.vocab_size == 512 and cfg.bos_token_id == BOS_ID and cfg.eos_token_ids == (EOS_ID,)
    weights = load_file(str(model_dir / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (cfg.kv_dim, 64)
    std = weights["model.layers.1.mlp.gate_proj.weight"].std().item()
    assert 0.02 <= std <= 0.2


def test_loads_in_transformers_and_greedy_output_depends_on_the_prompt(model_dir):
    model, tok = hf(model_dir)
    assert model.config.num_key_value_heads == ModelConfig.from_dir(model_dir).num_kv_heads
    outputs = [greedy(model, tok(p).input_ids) for p in PROMPTS]
    assert len({tuple(o) for o in outputs}) == len(PROMPTS), outputs
    logits = model(torch.tensor([tok(PROMPTS[0]).input_ids])).logits[0, -1]
    assert torch.isfinite(logits).all() and 0.1 < logits.std().item() < 10


def test_tokenizer_special_tokens_and_byte_level_round_trip(model_dir):
    from tokenizers import Tokenizer

    _, tok = hf(model_dir)
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (UNK_ID, BOS_ID, EOS_ID, PAD_ID)
    assert len(tok) == 512
    text = "The naïve café serves 3 soups — and 🍜!"
    ids = tok(text).input_ids
    assert ids[0] == BOS_ID and UNK_ID not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    # The gateway uses the `tokenizers` library directly: same ids.
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert raw.encode(text).ids == ids
    assert raw.decode(ids) == text


def test_chat_template_renders_with_role_markers(model_dir):
    _, tok = hf(model_dir)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nYou are brief.</s>\n<|user|>\nName a colour.</s>\n<|assistant|>\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(BOS_ID) == 1 and ids.count(EOS_ID) == 2
    for marker in ("<|system|>", "<|user|>", "<|assistant|>"):
        assert tok.convert_tokens_to_ids(marker) in ids  # one token each
    # Plain jinja2, as a server renders it, agrees with transformers.
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    rendered = jinja2.Environment().from_string(config["chat_template"]).render(
        messages=MESSAGES, add_generation_prompt=True, bos_token=config["bos_token"], eos_token=config["eos_token"])
    assert rendered == text


def test_seed_decides_the_weights(tmp_path):
    a = load_file(str(make_model(tmp_path / "a", seed=1) / "model.safetensors"))
    b = load_file(str(make_model(tmp_path / "b", seed=1) / "model.safetensors"))
    c = load_file(str(make_model(tmp_path / "c", seed=2) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_unknown_preset_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"unknown preset 'huge'; choose one of tiny, tiny-gqa"):
        make_model(tmp_path, preset="huge")


# ------------------------------------------------------------------ adapters

def test_adapters_load_in_peft_as_is_and_change_logits_and_greedy_output(tiny_model_dir, tiny_adapter_dirs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, tok = hf(tiny_model_dir)
    ids = tok(PROMPTS[1]).input_ids
    x = torch.tensor([ids])
    with torch.no_grad():
        base_logits = base(x).logits[0, -1]
    base_tokens = greedy(base, ids)
    seen = {tuple(base_tokens)}
    for folder, rank in zip(tiny_adapter_dirs, [8, 16, 4, 32]):
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == rank
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(folder)).eval()
        with torch.no_grad():
            logits = model(x).logits[0, -1]
        assert torch.isfinite(logits).all() and logits.abs().max() < 30
        assert (logits - base_logits).abs().max() > 0.3, folder.name
        tokens = greedy(model, ids)
        assert tuple(tokens) not in seen, f"{folder.name} did not change greedy output"
        seen.add(tuple(tokens))


def test_make_adapters_names_ranks_targets_and_patterns(tiny_gqa_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.from_dir(tiny_gqa_model_dir)
    folders = make_adapters(tmp_path, tiny_gqa_model_dir, 3, ranks=[2, 6], targets=["k_proj", "v_proj", "down_proj"],
                            seed=4, rank_pattern={"down_proj": 3, "model.layers.1.self_attn.k_proj": 5},
                            alpha_pattern={"v_proj": 1})
    assert [f.name for f in folders] == ["adapter-000", "adapter-001", "adapter-002"]
    for folder, r in zip(folders, [2, 6, 2]):
        w = load_adapter(folder, cfg)
        assert set(w.modules) == {"k_proj", "v_proj", "down_proj"}
        assert [m.rank for m in w.modules["k_proj"]] == [r, 5]
        assert [m.rank for m in w.modules["v_proj"]] == [r, r]
        assert [m.rank for m in w.modules["down_proj"]] == [3, 3]
        assert w.modules["v_proj"][0].scale == pytest.approx(1 / r)
        assert w.modules["k_proj"][1].scale == pytest.approx(16 / 5)
        # B is never zero, unlike PEFT's initialisation.
        assert all(m.lora_b.abs().sum() > 0 for layers in w.modules.values() for m in layers)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_gqa_model_dir), str(folders[1]))
    k1 = peft_model.base_model.model.model.layers[1].self_attn.k_proj
    assert k1.r["default"] == 5 and k1.scaling["default"] == pytest.approx(16 / 5)


def test_make_adapters_is_deterministic_per_seed(tiny_model_dir, tmp_path):
    a = make_adapters(tmp_path / "a", tiny_model_dir, 2, seed=9)
    b = make_adapters(tmp_path / "b", tiny_model_dir, 2, seed=9)
    c = make_adapters(tmp_path / "c", tiny_model_dir, 2, seed=10)
    read = lambda f: load_file(str(f / "adapter_model.safetensors"))  # noqa: E731
    assert all(torch.equal(read(a[1])[k], read(b[1])[k]) for k in read(a[1]))
    assert not torch.equal(read(a[0])["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
                           read(a[1])["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])
    assert not torch.equal(read(a[0])["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
                           read(c[0])["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(targets=["q_proj", "lm_head"]), r"unknown target module\(s\) \['lm_head'\]"),
    (dict(ranks=[8, 0]), r"ranks must be positive integers"),
])
def test_make_adapters_rejects_bad_arguments(kwargs, message, tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=message):
        make_adapters(tmp_path, tiny_model_dir, 1, **kwargs)


def test_make_adapters_needs_a_base_config(tmp_path):
    with pytest.raises(ValueError, match=r"has no config.json"):
        make_adapters(tmp_path / "out", tmp_path, 1)


# ------------------------------------------------------------------ the commands, as a user runs them

def test_make_model_and_make_adapters_commands_in_subprocesses(tmp_path):
    model_dir, adapters_dir = tmp_path / "model", tmp_path / "adapters"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = lambda *args: subprocess.run([sys.executable, "-m", "shared.cli", *args], capture_output=True,  # noqa: E731
                                       text=True, timeout=120, env=env, cwd=tmp_path)
    made = run("make-model", str(model_dir), "--preset", "tiny-gqa", "--seed", "3")
    assert made.returncode == 0, made.stderr
    assert ModelConfig.from_dir(model_dir).num_kv_heads == 2
    assert torch.equal(load_file(str(model_dir / "model.safetensors"))["lm_head.weight"],
                       load_file(str(make_model(tmp_path / "same", "tiny-gqa", seed=3) / "model.safetensors"))["lm_head.weight"])

    made = run("make-adapters", str(adapters_dir), "--base", str(model_dir), "--count", "12", "--ranks", "4,8,2",
               "--targets", "q_proj,o_proj", "--seed", "1")
    assert made.returncode == 0, made.stderr
    assert "12/12 adapters" in made.stderr  # progress
    cfg = ModelConfig.from_dir(model_dir)
    folders = sorted(adapters_dir.iterdir())
    assert [f.name for f in folders] == [f"adapter-{i:03d}" for i in range(12)]
    assert [load_adapter(f, cfg).max_rank for f in folders] == [4, 8, 2] * 4
    assert set(load_adapter(folders[0], cfg).modules) == {"q_proj", "o_proj"}
