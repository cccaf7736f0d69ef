"""The engine on the Triton backend gives the same greedy tokens and logits as on the torch reference ops.
Without a GPU the kernels run in Triton's interpreter, so the case is kept small."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.kernels import compiled_launch
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.adapter_format import load_adapter
from shared.config import EngineConfig
from shared.model_config import ModelConfig
from shared.tiny_model import make_model

from .oracle import make_peft_adapter


def run(base, adapters, backend: str, device: str, direct_launch: bool = False, kernel_shapes: str = ""):
    engine = Engine.from_model_dir(base, EngineConfig(device=device, num_slots=1024, max_lora_rank=16,
                                                      max_resident_adapters=4, direct_launch=direct_launch,
                                                      kernel_shapes=kernel_shapes),
                                   backend=backend)
    for name, w in adapters.items():
        engine.register_adapter(name, w)
    # "e" makes the first step's r16 segment longer than a 64-token chunk: its LoRA launches run from the
    # step's chunk list.
    requests = [("a", [5, 9, 13, 2, 40, 41, 42], "r3"), ("b", [7], None), ("c", list(range(3, 22)), "r16"),
                ("d", [11, 12, 13], "r3"), ("e", [3 + i % 50 for i in range(70)], "r16")]
    for rid, prompt, adapter in requests:
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True), adapter,
                                         return_logits=True))
    tokens, logits = {}, {}
    # "f" joins the decoding requests with a 71-token prompt: a mixed step of segments short on average (76
    # tokens over 3, one of them past a 64-token chunk), launched from its chunk list in 16-row tiles, its
    # shrink split planned for the 4 chunks listed.
    late = EngineRequest("f", [8, 30, 31, 6, 2] + [4 + i % 40 for i in range(66)],
                         SamplingParams(max_tokens=3, ignore_eos=True), "r3", return_logits=True)
    while engine.has_unfinished():
        if late is not None and engine.has_unfinished() and tokens:
            # A prompt joining decoding requests: a mixed step, whose decode rows lead its batch.
            engine.add_request(late)
            late = None
        for out in engine.step():
            assert out.error is None
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logits.setdefault(out.request_id, []).extend(l.cpu() for l in out.logits or [])
    return tokens, logits


def model_and_adapters(tmp_path):
    """A tiny GQA model and two adapters of ranks 3 and 16 that between them adapt all seven modules."""
    base = make_model(tmp_path / "model", preset="tiny-gqa", seed=2)
    cfg = ModelConfig.from_dir(base)
    return base, {
        "r3": load_adapter(make_peft_adapter(base, tmp_path / "r3", 1, r=3, lora_alpha=6,
                                             target_modules=["q_proj", "v_proj", "down_proj"]), cfg, 16),
        "r16": load_adapter(make_peft_adapter(base, tmp_path / "r16", 2, r=16, lora_alpha=8,
                                              target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]), cfg, 16),
    }


def test_triton_backend_matches_reference(tmp_path):
    base, adapters = model_and_adapters(tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref_tokens, ref_logits = run(base, adapters, "reference", "cpu")
    tokens, logits = run(base, adapters, "triton", device)
    assert tokens == ref_tokens
    for rid in ref_logits:
        for ours, ref in zip(logits[rid], ref_logits[rid]):
            assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
def test_kernels_launched_direct_give_bit_for_bit_what_ordinary_launches_give(tmp_path):
    """worker.direct_launch: every layer after the first launches the norm, rotary, KV write, attention,
    activation and LoRA kernels its first layer compiled, skipping Triton's binding; the tokens and logits are
    exactly those of ordinary launches."""
    base, adapters = model_and_adapters(tmp_path)
    tokens, logits = run(base, adapters, "triton", "cuda")
    before = compiled_launch.direct_calls()
    try:
        direct_tokens, direct_logits = run(base, adapters, "triton", "cuda", direct_launch=True)
    finally:
        compiled_launch.set_enabled(False)
    # The first step alone: its second layer's two norms, rotary, KV write, attention, activation and LoRA
    # shrink/expand of four module groups, direct.
    assert compiled_launch.direct_calls() - before >= 10
    assert direct_tokens == tokens
    for rid in logits:
        assert all(torch.equal(a, b) for a, b in zip(direct_logits[rid], logits[rid])), rid


def test_launch_shapes_set_for_the_worker_give_the_reference_tokens(tmp_path, monkeypatch):
    """worker.kernel_shapes: smaller decode attention blocks and stages, programs launched KV head and column tile
    first, and a mixed step's decode rows launched apart from its prompt change launches, not results; an engine
    built afterwards without them launches the kernels' own choice again."""
    from services.gpu_worker.kernels import paged_attention
    from services.gpu_worker.kernels.launch_shapes import launch_shapes
    from shared.kernel_shapes import LaunchShapes

    splits = []
    split_rows = paged_attention.split_decode_rows
    monkeypatch.setattr(paged_attention, "split_decode_rows", lambda meta: splits.append(meta.decode_seqs) or
                        split_rows(meta))

    base, adapters = model_and_adapters(tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref_tokens, ref_logits = run(base, adapters, "reference", "cpu")
    shapes = "attention_block_n=16,attention_stages=2,heads_first,split_mixed,expand_cols_first"
    tokens, logits = run(base, adapters, "triton", device, kernel_shapes=shapes)
    assert launch_shapes() == LaunchShapes(attention_block_n=16, attention_stages=2, heads_first=True, split_mixed=True,
                                           expand_cols_first=True)
    assert tokens == ref_tokens and set(tokens) == {"a", "b", "c", "d", "e", "f"}
    for rid in ref_logits:
        for ours, ref in zip(logits[rid], ref_logits[rid]):
            assert (ours - ref).abs().max().item() < 1e-4
    # The mixed step's decode rows (the five first requests') went apart, in every layer.
    assert splits and set(splits) == {5}, splits
    Engine.from_model_dir(base, EngineConfig(device=device, num_slots=64), backend="triton")
    assert launch_shapes() == LaunchShapes()
