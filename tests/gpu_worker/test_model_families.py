"""Checkpoint families and formats beyond the tiny Llama presets: Qwen2 (q/k/v bias), Mistral, sharded
safetensors, and half-precision dtypes, each against transformers on the same weights."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.config import EngineConfig

from .oracle import HFOracle

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=120, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, bos_token_id=0)


def save_random(kind: str, path, max_shard_size: str | None = None, **extra):
    import transformers

    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **extra))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.08)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def greedy(engine: Engine, prompts: list[list[int]], steps: int):
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, SamplingParams(max_tokens=steps, ignore_eos=True), return_logits=True))
    tokens, logits = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logits.setdefault(out.request_id, []).extend(out.logits or [])
    return [tokens[str(i)] for i in range(len(prompts))], [logits[str(i)] for i in range(len(prompts))]


PROMPTS = [[5, 6, 7, 8, 9], [100], list(range(20, 47))]


@pytest.mark.parametrize("kind,extra,shard", [
    ("qwen2", {}, None),
    ("mistral", {"sliding_window": 4096}, None),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "40KB"),
])
def test_family_matches_transformers(tmp_path, kind, extra, shard):
    path = save_random(kind, tmp_path / kind, shard, **extra)
    if shard:
        assert (path / "model.safetensors.index.json").exists(), "checkpoint was meant to be sharded"
    engine = Engine.from_model_dir(path, EngineConfig(num_slots=512))
    tokens, logits = greedy(engine, PROMPTS, 5)
    oracle = HFOracle(path, {})
    for prompt, ours_tokens, ours_logits in zip(PROMPTS, tokens, logits):
        ref_tokens, ref_logits = oracle.greedy(prompt, None, 5)
        assert ours_tokens == ref_tokens
        for a, b in zip(ours_logits, ref_logits):
            assert (a - b).abs().max().item() < 1e-4


def test_sliding_window_caps_the_context(tmp_path):
    path = save_random("mistral", tmp_path / "m", sliding_window=32)
    engine = Engine.from_model_dir(path, EngineConfig(num_slots=512))
    assert engine.max_model_len == 32
    with pytest.raises(ValueError, match="context length 32"):
        engine.add_request(EngineRequest("long", list(range(2, 40)), SamplingParams(max_tokens=1)))


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.15), ("float16", 0.03)])
def test_half_precision_tracks_fp32(tmp_path, dtype, tol):
    path = save_random("llama", tmp_path / "l")
    _, ref = greedy(Engine.from_model_dir(path, EngineConfig(num_slots=512)), PROMPTS, 1)
    _, half = greedy(Engine.from_model_dir(path, EngineConfig(num_slots=512, dtype=dtype)), PROMPTS, 1)
    for a, b in zip(half, ref):
        assert a[0].dtype == torch.float32
        assert (a[0] - b[0]).abs().max().item() < tol
