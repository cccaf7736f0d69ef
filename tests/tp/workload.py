"""Drive an engine (single-GPU or TP) through a fixed workload: requests on different adapters joining at
different steps; collect every request's tokens and per-step logits."""
from __future__ import annotations

import random

import torch

from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams

MAX_TOKENS = 6


def make_workload(vocab_size: int, adapters: list[str | None], count: int = 12, seed: int = 7) -> list[tuple]:
    """(request id, prompt, adapter, join step); adapters taken in turn, base-only (None) among them."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        length = rng.choice([1, 2, 5, 9, 17, 33])
        prompt = [rng.randrange(3, vocab_size) for _ in range(length)]
        out.append((f"req{i}", prompt, adapters[i % len(adapters)], i // 3))
    return out


def run(engine, adapters: dict, workload: list[tuple], max_tokens: int = MAX_TOKENS) -> tuple[dict, dict]:
    for name, w in adapters.items():
        engine.register_adapter(name, w)
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    last_join = max(w[3] for w in workload)
    for step in range(1000):
        for rid, prompt, adapter, join in workload:
            if join == step:
                engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                                 adapter, return_logits=True))
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logits.setdefault(out.request_id, []).extend(out.logits or [])
        if step >= last_join and not engine.has_unfinished():
            break
    return tokens, logits


def assert_same_output(expected: tuple[dict, dict], got: tuple[dict, dict], tol: float = 1e-4,
                       max_tokens: int = MAX_TOKENS) -> None:
    ref_tokens, ref_logits = expected
    tokens, logits = got
    assert set(tokens) == set(ref_tokens)
    for rid in ref_tokens:
        assert tokens[rid] == ref_tokens[rid], f"{rid}: TP {tokens[rid]} != single-GPU {ref_tokens[rid]}"
        assert len(logits[rid]) == len(ref_logits[rid]) == max_tokens
        for step, (ours, ref) in enumerate(zip(logits[rid], ref_logits[rid])):
            diff = (ours - ref).abs().max().item()
            assert diff < tol, f"{rid} step {step}: logits differ by {diff}"
