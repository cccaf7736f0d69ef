"""HTTP front of the PEFT baseline: the subset of the gateway's API the load client uses, same wire format.

POST /v1/completions (JSON or SSE stream), GET /v1/models, GET /health, plus GET /stats (the batch log, to
check grouping from outside) and GET /metrics (the gateway's metric names where they mean the same thing).
Bodies are checked by the gateway's own validation, errors and SSE chunks are the gateway's own shapes, so a
client cannot tell the two servers apart by format. Sampling is not implemented: greedy only.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bench.baselines.grouping import BatchLog, GroupingQueue, PendingRequest, QueueClosed
from services.gateway.detokenize import IncrementalDetokenizer
from services.gateway.errors import ApiError, bad_request, exception_handlers
from services.gateway.generation import CLIENT_GONE, ClientGone, Usage
from services.gateway.inference import STREAM_HEADERS, EventStream, ResponseShape, read_body, watch_disconnect
from services.gateway.sse import DONE, event
from services.gateway.tokenizer import ModelTokenizer
from services.gateway.validation import (
    GenerationRequest, check_prompt_ids, parse_completion, parse_json, resolve_max_tokens,
)
from shared.log import get_logger

MAX_BODY_BYTES = 16 * 1024 * 1024
WORKER = "peft"  # the `worker` label of the gateway-named metrics


@dataclass
class PeftService:
    """Everything the handlers need; the worker thread and the adapter cache are read for stats only."""

    base_name: str
    adapter_names: set[str]
    vocab_size: int
    max_model_len: int
    stop_token_ids: frozenset[int]
    queue: GroupingQueue
    batches: BatchLog
    tokenizer: ModelTokenizer | None = None
    default_max_tokens: int = 16
    cache_stats: Callable[[], dict] = dict  # AdapterCache.stats
    running: Callable[[], int] = lambda: 0  # requests in the batch on the GPU now
    gpu_memory: Callable[[], dict] = dict  # {"allocated": bytes, ...}, or {} off CUDA
    log: Any = field(default_factory=lambda: get_logger("peft_baseline"))

    def resolve_model(self, name: str) -> str | None:
        if name == self.base_name:
            return None
        if name in self.adapter_names:
            return name
        raise ApiError(404, f"the model {name!r} does not exist", "model", "model_not_found")

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        if req.prompt_ids is not None:
            check_prompt_ids(req.prompt_ids, self.vocab_size, "prompt")
            return req.prompt_ids
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer: send the prompt as a list of token ids", "prompt",
                              "invalid_type")
        return self.tokenizer.encode(req.prompt_text)


def _check_greedy(body: dict, req: GenerationRequest) -> None:
    """Refuse what this baseline does not do, rather than silently doing something else."""
    if body.get("temperature") is None or req.temperature != 0:
        raise bad_request("this server decodes greedily only: temperature must be 0", "temperature",
                          "unsupported_parameter")
    if req.top_p != 1.0:
        raise bad_request("top_p is not supported by this server (greedy decoding)", "top_p", "unsupported_parameter")
    if req.top_k != -1:
        raise bad_request("top_k is not supported by this server (greedy decoding)", "top_k", "unsupported_parameter")
    if req.stop:
        raise bad_request("stop strings are not supported by this server", "stop", "unsupported_parameter")


async def completions(request: Request) -> Response:
    svc: PeftService = request.app.state.peft
    body = parse_json(await read_body(request, MAX_BODY_BYTES))
    req = parse_completion(body)
    _check_greedy(body, req)
    adapter = svc.resolve_model(req.model)
    prompt = svc.prompt_ids(req)
    max_tokens = resolve_max_tokens(req, len(prompt), svc.max_model_len, svc.default_max_tokens)

    events: asyncio.Queue = asyncio.Queue()
    rid = "cmpl-" + uuid.uuid4().hex
    pending = PendingRequest(request_id=rid, adapter=adapter, prompt_ids=prompt, max_tokens=max_tokens,
                             stop_token_ids=frozenset() if req.ignore_eos else svc.stop_token_ids,
                             sink=events.put_nowait)
    try:
        svc.queue.put(pending)
    except QueueClosed as e:
        raise ApiError(503, str(e), None, "shutting_down", retry_after=1) from None
    shape = ResponseShape(rid, req.model, False, int(time.time()))
    detok = IncrementalDetokenizer(svc.tokenizer.tokenizer) if svc.tokenizer is not None else None
    # The body has been read, so the request's next ASGI message is its disconnect: watching for it lets a
    # request whose client gave up (a load client's timeout) leave the queue instead of running later.
    watcher = asyncio.create_task(watch_disconnect(request, events))
    tokens = _Tokens(pending, events, detok, Usage(len(prompt)), watcher)
    if req.stream:
        return EventStream(_sse(shape, tokens, req.include_usage), headers=STREAM_HEADERS)
    texts, reason = [], None
    try:
        async for text, reason in tokens:
            texts.append(text)
    except _Failed as e:
        return ApiError(500, str(e), None, "generation_failed").response()
    except ClientGone:
        return Response(status_code=499)
    finally:
        tokens.close()
    return JSONResponse(shape.full("".join(texts), reason, tokens.usage.as_dict()))


class _Failed(Exception):
    pass


class _Tokens:
    """The request's (text, finish_reason) per generated token; closing it early cancels the request."""

    def __init__(self, pending: PendingRequest, events: asyncio.Queue, detok, usage: Usage, watcher: asyncio.Task):
        self.pending, self.events, self.detok, self.usage, self.watcher = pending, events, detok, usage, watcher
        self.done = False  # set here, on the loop: the worker's `finished` runs ahead of delivery

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[str, str | None]:
        if self.done:
            raise StopAsyncIteration
        item = await self.events.get()
        if item is CLIENT_GONE:
            self.close()
            raise ClientGone()
        if isinstance(item, str):
            self.done = True
            raise _Failed(item)
        token, reason = item
        self.usage.completion_tokens += 1
        text = ""
        if self.detok is not None:
            text = self.detok.push([token])
            if reason is not None:
                text += self.detok.flush()
        self.done = reason is not None
        return text, reason

    def close(self) -> None:
        # A client that leaves before its batch starts is dropped from the queue; one that leaves
        # mid-batch stops receiving (its row runs on with the batch, as in a padded batch it must).
        self.watcher.cancel()
        if not self.done:
            self.done = True
            self.pending.cancelled = True


async def _sse(shape: ResponseShape, tokens: _Tokens, include_usage: bool):
    # One chunk per generated token (also when it adds no text), so first-token time and token counts are
    # read off the stream exactly; the last token's chunk carries the finish reason, as the gateway's does.
    try:
        try:
            async for text, reason in tokens:
                yield event(shape.chunk(text, reason, with_usage=include_usage))
        except _Failed as e:
            yield event({"error": {"message": str(e), "type": "server_error", "param": None,
                                   "code": "generation_failed"}})
            yield DONE
            return
        except ClientGone:
            return
        if include_usage:
            yield event(shape.usage_chunk(tokens.usage.as_dict()))
        yield DONE
    finally:
        tokens.close()


async def list_models(request: Request) -> Response:
    svc: PeftService = request.app.state.peft
    resident = set(svc.cache_stats().get("resident", []))
    data = [{"id": svc.base_name, "object": "model", "created": 0, "owned_by": "peft-baseline", "root": svc.base_name,
             "parent": None, "max_model_len": svc.max_model_len, "residency": "gpu"}]
    for name in sorted(svc.adapter_names):
        data.append({"id": name, "object": "model", "created": 0, "owned_by": "peft-baseline", "root": svc.base_name,
                     "parent": svc.base_name, "residency": "gpu" if name in resident else "disk"})
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def stats(request: Request) -> Response:
    svc: PeftService = request.app.state.peft
    return JSONResponse({"base_model": svc.base_name, "max_batch": svc.queue.max_batch,
                         "queue_depth": svc.queue.depth(), "running": svc.running(), **svc.cache_stats(),
                         "gpu_memory": svc.gpu_memory(), **svc.batches.snapshot()})


class _Collector:
    """Gateway metric names for the same quantities, so the bench's /metrics sampler reads both servers."""

    def __init__(self, svc: PeftService):
        self.svc = svc

    def collect(self):
        svc, cache = self.svc, self.svc.cache_stats()
        depth = GaugeMetricFamily("loraplex_queue_depth", "Requests waiting in the queue")
        depth.add_metric([], svc.queue.depth())
        running = GaugeMetricFamily("loraplex_running_requests", "Requests running on each worker", labels=["worker"])
        running.add_metric([WORKER], svc.running())
        loads = CounterMetricFamily("loraplex_adapter_loads", "Adapters loaded onto the device", labels=["worker"])
        loads.add_metric([WORKER], cache.get("adapter_loads", 0))
        load_bytes = CounterMetricFamily("loraplex_adapter_load_bytes", "Bytes of adapters loaded onto the device",
                                         labels=["worker"])
        load_bytes.add_metric([WORKER], cache.get("adapter_load_bytes", 0))
        tiers = GaugeMetricFamily("loraplex_adapters_resident", "Adapters held per tier", labels=["tier"])
        on_gpu = len(cache.get("resident", []))
        tiers.add_metric(["gpu"], on_gpu)
        tiers.add_metric(["disk"], len(svc.adapter_names) - on_gpu)
        generated = CounterMetricFamily("loraplex_generation_tokens", "Tokens generated")
        generated.add_metric([], svc.batches.generated_tokens)
        yield from (depth, running, loads, load_bytes, tiers, generated)


def build_app(svc: PeftService, lifespan=None) -> Starlette:
    registry = CollectorRegistry()
    registry.register(_Collector(svc))

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers=exception_handlers(lambda request: request.app.state.peft.log))
    app.state.peft = svc
    return app
