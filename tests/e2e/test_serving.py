"""Through HTTP, the whole stack serves exactly what the in-process engine computes (and so what
transformers + peft compute): many concurrent greedy requests over adapters of mixed ranks and target
modules and the base model; streaming and non-streaming agree; the `openai` client works against it."""
from __future__ import annotations

import asyncio
import json

import httpx
from tokenizers import Tokenizer

from services.gpu_worker.engine import Engine
from services.gpu_worker.requests import EngineRequest
from services.gpu_worker.sampling import SamplingParams
from shared.adapter_format import load_adapter
from shared.config import EngineConfig
from shared.model_config import ModelConfig

BASE = "model"  # the embedded default model's folder name, which is its served name


def cases(adapter_names: list[str], n: int = 32) -> list[dict]:
    """n requests: every adapter and the base model, prompts of different lengths, different max_tokens."""
    models = adapter_names + [BASE]
    out = []
    for i in range(n):
        prompt = [1] + [(7 * i + 13 * j) % 500 + 5 for j in range(3 + (i * 5) % 37)]
        out.append({"id": f"r{i}", "model": models[i % len(models)], "prompt": prompt, "max_tokens": 6 + i % 11})
    return out


def reference_texts(model_dir, adapter_dirs: dict, requests: list[dict], engine_config: dict | None = None) -> dict[str, tuple[str, int]]:
    """Text and token count of each request from the in-process engine, decoded as the gateway decodes."""
    cfg = ModelConfig.from_dir(model_dir)
    engine = Engine.from_model_dir(model_dir, EngineConfig(**(engine_config or {"num_slots": 4096})))
    for name, folder in adapter_dirs.items():
        engine.register_adapter(name, load_adapter(folder, cfg, name=name))
    for r in requests:
        adapter = None if r["model"] == BASE else r["model"]
        engine.add_request(EngineRequest(r["id"], r["prompt"], SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
                                         adapter=adapter))
    ids = {r["id"]: [] for r in requests}
    while engine.has_unfinished():
        for o in engine.step():
            ids[o.request_id] += o.new_token_ids
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return {rid: (tok.decode(t, skip_special_tokens=True), len(t)) for rid, t in ids.items()}


def body(r: dict, stream: bool) -> dict:
    b = {"model": r["model"], "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
         "ignore_eos": True, "stream": stream}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


async def complete(client: httpx.AsyncClient, r: dict) -> tuple[str, int, str]:
    resp = await client.post("/v1/completions", json=body(r, False))
    assert resp.status_code == 200, resp.text
    data = resp.json()
    return data["choices"][0]["text"], data["usage"]["completion_tokens"], data["choices"][0]["finish_reason"]


async def complete_streaming(client: httpx.AsyncClient, r: dict) -> tuple[str, int, str]:
    text, usage, finish = [], None, None
    async with client.stream("POST", "/v1/completions", json=body(r, True)) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"].startswith("text/event-stream")
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            event = json.loads(payload)
            for choice in event["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
        assert done, "stream ended without [DONE]"
    return "".join(text), usage, finish


async def run_all(url: str, requests: list[dict], fn) -> dict[str, tuple[str, int, str]]:
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        results = await asyncio.gather(*(fn(client, r) for r in requests))
    return {r["id"]: res for r, res in zip(requests, results)}


def test_32_concurrent_greedy_requests_match_the_in_process_engine(stack, model_dir, mixed_adapters):
    requests = cases(sorted(mixed_adapters))
    assert {r["model"] for r in requests} == set(mixed_adapters) | {BASE}
    expected = reference_texts(model_dir, mixed_adapters, requests)

    plain = asyncio.run(run_all(stack.url, requests, complete))
    streamed = asyncio.run(run_all(stack.url, requests, complete_streaming))
    for r in requests:
        text, count = expected[r["id"]]
        assert count == r["max_tokens"]
        assert plain[r["id"]] == (text, count, "length"), r
        assert streamed[r["id"]] == (text, count, "length"), r
    # The adapters really changed the outputs (the comparison above would be weak otherwise).
    assert len({expected[r["id"]][0] for r in requests[:9]}) == 9


def test_openai_client_completions_chat_and_streaming(stack, mixed_adapters):
    import openai  # a test dependency only this test needs

    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=60, max_retries=0)
    name = sorted(mixed_adapters)[0]
    ids = {m.id for m in client.models.list().data}
    assert BASE in ids and name in ids

    completion = client.completions.create(model=name, prompt="the quick brown fox", max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    chunks = list(client.completions.create(model=name, prompt="the quick brown fox", max_tokens=5, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text

    messages = [{"role": "user", "content": "say something"}]
    chat = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 6
