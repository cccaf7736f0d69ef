"""POST /v1/completions and /v1/chat/completions.

1) authenticate, parse and validate the body, resolve the model, tokenize, check lengths: any failure is
   an error response and nothing is queued; 2) submit to the scheduler; 3) wait for the first event
   before sending a status line, so a refusal (queue full, SLO) is still a proper HTTP error; 4) stream
   SSE chunks or collect one JSON body. A client that disconnects at any point aborts its request.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.gateway.detokenize import IncrementalDetokenizer
from services.gateway.errors import ApiError, bad_request
from services.gateway.generation import CLIENT_GONE, ClientGone, Generation, GenerationFailed, Usage
from services.gateway.scheduler_client import SchedulerLost
from services.gateway.sse import DONE, event
from services.gateway.state import GatewayState
from services.gateway.stop_strings import StopStrings
from services.gateway.tokenizer import ChatTemplateError
from services.gateway.validation import (
    GenerationRequest, check_prompt_ids, parse_chat, parse_completion, parse_json, resolve_max_tokens,
)
from shared.wire import SubmitRequest

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing with 413 as soon as it grows past `limit` (never buffers more than that)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "Content-Length is not a number", None, "invalid_header")
        if int(declared) > limit:
            raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit}", None, "payload_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds the limit of {limit} bytes", None, "payload_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the body", None, "client_disconnected") from None
    body = b"".join(chunks)
    request._body = body  # later readers (form parsing) see the same bytes
    return body


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


def _tokenize(state: GatewayState, req: GenerationRequest) -> list[int]:
    tok = state.tokenizer
    if req.chat:
        try:
            return tok.encode_chat(req.messages)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
    if req.prompt_ids is not None:
        check_prompt_ids(req.prompt_ids, state.model.vocab_size, "prompt")
        return req.prompt_ids
    return tok.encode(req.prompt_text)


async def _generate(request: Request, chat: bool) -> Response:
    state: GatewayState = request.app.state.gateway
    endpoint = "chat" if chat else "completions"
    metrics = state.metrics
    try:
        caller = state.keys.caller(request.headers.get("authorization"))
        body = parse_json(await read_body(request, state.config.max_body_bytes))
        req = parse_chat(body) if chat else parse_completion(body)
        adapter = await state.resolve_model(req.model, caller)
        prompt_ids = _tokenize(state, req)
        max_tokens = resolve_max_tokens(req, len(prompt_ids), state.max_model_len,
                                        None if chat else state.config.default_max_tokens)
        state.check_serving()
    except ApiError as e:
        metrics.requests.labels(endpoint=endpoint, status=str(e.status)).inc()
        metrics.rejections.labels(reason=e.code or "invalid_request").inc()
        return e.response()

    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    submit = SubmitRequest(
        request_id=rid, prompt_ids=prompt_ids, adapter=adapter, tenant=caller.tenant, max_tokens=max_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
        stop_token_ids=[] if req.ignore_eos else list(state.stop_token_ids), ignore_eos=req.ignore_eos,
        arrival_time=time.time(),
    )
    scheduler = state.scheduler
    events = scheduler.open(rid)
    gen = Generation(rid, events, IncrementalDetokenizer(state.tokenizer.tokenizer), StopStrings(req.stop),
                     Usage(len(prompt_ids)), scheduler, metrics)
    try:
        scheduler.submit(submit)
    except SchedulerLost as e:
        scheduler.forget(rid)
        metrics.requests.labels(endpoint=endpoint, status="503").inc()
        return ApiError(503, str(e), None, "scheduler_unavailable", retry_after=1).response()
    state.inflight += 1
    watcher = asyncio.create_task(watch_disconnect(request, events))
    log = state.log.bind(request_id=rid, model=req.model, tenant=caller.tenant)
    pieces = gen.deltas()
    done = False

    def cleanup(reason: str) -> None:
        nonlocal done
        if done:
            return
        done = True
        watcher.cancel()
        state.inflight -= 1
        if gen.finished:
            scheduler.forget(rid)
        else:
            scheduler.abort(rid, reason)
            if reason == "client_disconnect":
                metrics.aborts.labels(reason=reason).inc()
                log.info("client disconnected; request aborted")

    # Nothing is sent before the first event: a refusal can still be an HTTP error status.
    try:
        first = await pieces.__anext__()
    except StopAsyncIteration:
        first = None
    except ApiError as e:
        cleanup("refused")
        metrics.requests.labels(endpoint=endpoint, status=str(e.status)).inc()
        return e.response()
    except ClientGone:
        cleanup("client_disconnect")
        metrics.requests.labels(endpoint=endpoint, status="499").inc()
        return Response(status_code=499)
    except BaseException:
        cleanup("cancelled")
        raise

    shape = ResponseShape(rid, req.model, chat, int(time.time()))
    if req.stream:
        metrics.requests.labels(endpoint=endpoint, status="200").inc()
        return EventStream(_sse(shape, first, pieces, gen, req.include_usage, cleanup), headers=STREAM_HEADERS)
    try:
        texts = [first[0]] if first else []
        async for text, _ in pieces:
            texts.append(text)
    except ClientGone:
        cleanup("client_disconnect")
        metrics.requests.labels(endpoint=endpoint, status="499").inc()
        return Response(status_code=499)
    except (GenerationFailed, ApiError) as e:
        cleanup("failed")
        metrics.requests.labels(endpoint=endpoint, status="503").inc()
        return ApiError(503, str(e), None, "generation_failed", retry_after=1).response()
    finally:
        cleanup("cancelled")
    metrics.requests.labels(endpoint=endpoint, status="200").inc()
    return JSONResponse(shape.full("".join(texts), gen.finish_reason, gen.usage.as_dict()))


async def watch_disconnect(request: Request, events: asyncio.Queue) -> None:
    # The body has been read, so the next ASGI message for this request is its disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            events.put_nowait(CLIENT_GONE)
            return


class ResponseShape:
    """OpenAI's response objects for one request."""

    def __init__(self, rid: str, model: str, chat: bool, created: int):
        self.rid, self.model, self.chat, self.created = rid, model, chat, created

    def _base(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str | None, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return {**self._base("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False, with_usage: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._base("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            out = {**self._base("text_completion"), "choices": [choice]}
        if with_usage:
            out["usage"] = None  # OpenAI sends usage: null on every chunk when include_usage is on
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [], "usage": usage}


async def _sse(shape: ResponseShape, first, pieces, gen: Generation, include_usage: bool, cleanup):
    try:
        if shape.chat:
            yield event(shape.chunk("", None, first=True, with_usage=include_usage))
        items = [first] if first else []
        while True:
            for text, reason in items:
                if text or reason:
                    yield event(shape.chunk(text, reason, with_usage=include_usage))
            if gen.finished:
                break
            try:
                items = [await pieces.__anext__()]
            except StopAsyncIteration:
                break
        if include_usage:
            yield event(shape.usage_chunk(gen.usage.as_dict()))
        yield DONE
    except ClientGone:
        cleanup("client_disconnect")
    except (GenerationFailed, ApiError) as e:
        cleanup("failed")
        yield event({"error": {"message": str(e), "type": "server_error", "param": None, "code": "generation_failed"}})
        yield DONE
    finally:
        cleanup("client_disconnect")


class EventStream(StreamingResponse):
    """An SSE response. Unlike StreamingResponse it leaves the ASGI receive channel to the request's
    disconnect watcher, which turns a vanished client into an event on the request's own queue."""

    def __init__(self, chunks, headers: dict):
        super().__init__(chunks, headers=headers, media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client is gone (ASGI 2.4 servers raise on send); the stream's cleanup aborts the request
        finally:
            await self.body_iterator.aclose()
