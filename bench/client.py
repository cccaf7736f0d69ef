"""The open-loop load client: sends each trace request at its arrival time, whatever the server is doing,
streams the answer and records when its first token and its end arrived.

httpx.AsyncClients with no connection cap carry the requests (each in-flight stream holds its own HTTP/1.1
connection; a cap would queue arrivals in the client and hide the server's queueing). One client takes at
most STREAMS_PER_CLIENT streams at a time and more clients are opened as needed: httpcore's connection
pool rescans all its connections (quadratically, while any is idle) on every request start and end, which
with 1000 streams in one pool took 21 s of a 39 s run's CPU (measured with cProfile). The stream
is read as raw bytes and split on the SSE event separator; JSON is parsed only for the events that need it
(an error, the final usage chunk), so per-token work of our own is a few byte searches. A request's
failure (HTTP status, transport error, error event, timeout) is written into its record; nothing about
one request raises out of the run.

httpx itself still costs ~0.1 ms of CPU per streamed token (measured: 108-130 µs on this project's CI
machine), so one event loop saturates near 8k tokens/s and its timings lag well before that. A trace whose
offered token rate is high is therefore split round-robin (in arrival order) over several client
processes (`python -m bench.client`, JSON over pipes), each with its own event loop and AsyncClient, all
timed on the host's one CLOCK_MONOTONIC and started at one agreed instant.

Output tokens are the `usage.completion_tokens` of the final chunk (asked for with `stream_options:
{"include_usage": true}`); a server that does not send usage gets its non-empty text chunks counted
instead. The first-token time is the arrival of the first chunk that carries a choice: the gateway sends
a chunk only when its text is non-empty (a token that ends inside a UTF-8 character is held back), which
is what a streaming user sees.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import os
import resource
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm import tqdm

from bench import child_env
from bench.workload import TraceRequest

ERROR_TEXT_MAX = 300  # characters of a server's error message kept in a record
STREAMS_PER_CLIENT = 16  # bounds the cost of httpcore's per-event pool scans (see above)
TOKENS_PER_PROCESS_S = 2500  # offered output tokens/s one client process takes (~30% of a core in httpx)
SHARD_START_TIMEOUT_S = 120.0
clock = time.monotonic  # CLOCK_MONOTONIC on Linux: one timeline for every client process of the host


@dataclass
class RequestRecord:
    """One request of a run; times in seconds after the run's start (the trace's time zero)."""

    index: int
    adapter: int | None
    prompt_len: int
    output_len: int
    arrival_s: float  # when the trace says it arrives
    sent_s: float | None = None  # when the client began sending it (arrival plus client lag)
    first_token_s: float | None = None
    finish_s: float | None = None  # when its exchange ended: last byte of the stream, or the failure
    output_tokens: int = 0
    error: str | None = None  # None = completed; else "HTTP 429: queue is full", "timeout ...", ...
    status: int | None = None  # HTTP status of the answer; None when none came (transport error, timeout)
    model: str = ""  # the `model` it was sent to (an adapter's name or the base model's)

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_s is not None


class _Stream:
    """Incremental SSE reader for one completion stream."""

    __slots__ = ("buf", "first", "chunks", "usage_tokens", "done", "error")

    def __init__(self):
        self.buf = b""
        self.first = False  # a choice chunk has arrived
        self.chunks = 0  # chunks with non-empty text
        self.usage_tokens: int | None = None
        self.done = False
        self.error: str | None = None

    def feed(self, data: bytes) -> bool:
        """Consume bytes; True when this call delivered the stream's first choice chunk."""
        if self.buf:
            data = self.buf + data
        if b"\r" in data:  # CRLF framing (allowed by SSE): a CR left at the end of buf pairs with this LF
            data = data.replace(b"\r\n", b"\n")
        was_first = self.first
        start = 0
        while (end := data.find(b"\n\n", start)) >= 0:
            self._event(data[start:end])
            start = end + 2
        self.buf = data[start:]
        return self.first and not was_first

    def _event(self, ev: bytes) -> None:
        i = ev.find(b"data:")
        if i < 0:
            return  # a comment or keep-alive
        payload = ev[i + 5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        # JSON strings escape their quotes, so these keys cannot be matched inside generated text.
        if b'"error"' in payload:
            obj = json.loads(payload)
            err = obj.get("error") if isinstance(obj, dict) else None
            if err:
                msg = err.get("message", err) if isinstance(err, dict) else err
                self.error = f"stream error: {str(msg)[:ERROR_TEXT_MAX]}"
                return
        if b'"completion_tokens"' in payload:
            usage = json.loads(payload).get("usage") or {}
            if isinstance(usage.get("completion_tokens"), int):
                self.usage_tokens = usage["completion_tokens"]
            if b'"choices":[]' in payload or b'"choices": []' in payload:
                return  # the usage-only chunk
        self.first = True
        if b'"text":""' not in payload and b'"text": ""' not in payload:
            self.chunks += 1

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks


def prompt_ids(seed: int, index: int, length: int, vocab_size: int) -> list[int]:
    """The prompt of request `index`: `length` token ids, uniform over the vocabulary, fixed by (seed, index)."""
    return np.random.default_rng([seed, index]).integers(0, vocab_size, length).tolist()


def _error_text(status: int, body: bytes) -> str:
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body.decode("utf-8", "replace").strip()
    return f"HTTP {status}: {str(msg)[:ERROR_TEXT_MAX]}"


def _raise_fd_limit() -> None:
    """Thousands of concurrent streams need as many sockets; the default soft limit is often 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass


@dataclass
class _Counts:
    sent: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0


class _Progress:
    """Completed/total, in flight, failures and recent throughput on a tqdm bar, refreshed twice a second
    by a task (never per token or per request). Counts come from this process or from client shards."""

    WINDOW_S = 10.0

    def __init__(self, total: int, enabled: bool):
        self.local = _Counts()
        self.shards: dict[int, _Counts] = {}
        self.enabled = enabled
        self.bar = tqdm(total=total, unit="req", disable=not enabled, dynamic_ncols=True, smoothing=0,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
        self.history: collections.deque = collections.deque()

    def totals(self) -> _Counts:
        out = dataclasses.replace(self.local)
        for c in self.shards.values():
            out.sent += c.sent
            out.done += c.done
            out.failed += c.failed
            out.tokens += c.tokens
        return out

    async def refresh_forever(self, period_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.refresh()

    def refresh(self) -> None:
        if not self.enabled:
            return
        c, now = self.totals(), clock()
        self.history.append((now, c.done, c.tokens))
        while now - self.history[0][0] > self.WINDOW_S:
            self.history.popleft()
        t, d, k = self.history[0]
        span = now - t
        rps, tok_s = ((c.done - d) / span, (c.tokens - k) / span) if span > 0 else (0.0, 0.0)
        self.bar.n = c.done
        self.bar.set_postfix_str(f"in flight {c.sent - c.done}, failed {c.failed}, {rps:.1f} req/s, "
                                 f"{tok_s:.0f} tok/s", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.refresh()
        self.bar.close()


async def _send(client: httpx.AsyncClient, rec: RequestRecord, body: dict, t0: float, timeout_s: float,
                counts: _Counts) -> None:
    rec.sent_s = clock() - t0
    counts.sent += 1
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    rec.error = _error_text(resp.status_code, await resp.aread())
                    return
                stream = _Stream()
                async for data in resp.aiter_raw():
                    if stream.feed(data):
                        rec.first_token_s = clock() - t0
                rec.output_tokens = stream.output_tokens
                if stream.error:
                    rec.error = stream.error
                elif not stream.done:
                    rec.error = "the stream ended before [DONE]"
                elif not stream.first:
                    rec.error = "the stream carried no tokens"
    except asyncio.CancelledError:
        rec.error = "cancelled: the run stopped before this request ended"
        raise
    except TimeoutError:
        rec.error = f"timeout: no complete answer within {timeout_s:g}s"
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {str(e)[:ERROR_TEXT_MAX]}"
    except (ValueError, TypeError, AttributeError) as e:  # an event that is not the JSON it claims to be
        rec.error = f"bad stream: {type(e).__name__}: {str(e)[:ERROR_TEXT_MAX]}"
    finally:
        rec.finish_s = clock() - t0
        counts.done += 1
        if rec.error is None:
            counts.tokens += rec.output_tokens
        else:
            counts.failed += 1


class _Clients:
    """AsyncClients made on demand; acquire() gives the index of one carrying fewer than
    STREAMS_PER_CLIENT streams (the first such, so streams pack onto few clients and reuse their
    kept-alive connections)."""

    def __init__(self, make: Callable[[], httpx.AsyncClient]):
        self.make = make
        self.clients: list[httpx.AsyncClient] = []
        self.streams: list[int] = []

    def acquire(self) -> int:
        for k, n in enumerate(self.streams):
            if n < STREAMS_PER_CLIENT:
                break
        else:
            self.clients.append(self.make())
            self.streams.append(0)
            k = len(self.clients) - 1
        self.streams[k] += 1
        return k

    def release(self, k: int) -> None:
        self.streams[k] -= 1

    async def __aenter__(self) -> _Clients:
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)


async def _run_shard(base_url: str, jobs: list[tuple[RequestRecord, str]], start: Callable[[], Awaitable[float]],
                     api_key: str | None, timeout_s: float, seed: int, vocab_size: int, counts: _Counts) -> None:
    """Send each (record, model) at t0 + arrival_s, where t0 = await start() once the client is warm;
    fill the records; return when all have ended."""
    _raise_fd_limit()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # A read timeout would only bound the gap between two tokens; the request's deadline is one
    # asyncio.timeout around the whole exchange instead (in _send).
    timeout = httpx.Timeout(None, connect=min(60.0, timeout_s))

    # One SSL context for every client: each would otherwise load the CA bundle (measured: 42 ms apiece).
    ssl_context = ssl.create_default_context()
    clients = _Clients(lambda: httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout,
                                                 verify=ssl_context))

    async def send(rec: RequestRecord, model: str) -> None:
        body = {"model": model, "prompt": prompt_ids(seed, rec.index, rec.prompt_len, vocab_size),
                "max_tokens": rec.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        k = clients.acquire()
        try:
            await _send(clients.clients[k], rec, body, t0, timeout_s, counts)
        finally:
            clients.release(k)

    async with clients:
        # The first request through httpx pays for lazy imports and backend set-up (measured: 0.1-0.8 s
        # of lag on the first arrivals); pay it before time zero. Any answer, even an error, warms it.
        try:
            await clients.clients[clients.acquire()].get("/health", timeout=10.0)
        except httpx.HTTPError:
            pass
        clients.release(0)
        t0 = await start()
        tasks = []
        try:
            for rec, model in sorted(jobs, key=lambda j: j[0].arrival_s):
                delay = t0 + rec.arrival_s - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(rec, model)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def auto_processes(trace: Sequence[TraceRequest]) -> int:
    """Client processes for a trace: its offered output tokens/s over TOKENS_PER_PROCESS_S, at most a
    third of the host's cores (the server's processes share the host: gateway, scheduler, store, worker,
    Redis). 16 cores and 40 req/s of ~260 tokens: 5 processes at ~2100 tokens/s each."""
    if not trace:
        return 1
    span = max(max(r.arrival_s for r in trace), 1.0)
    rate = sum(r.output_len for r in trace) / span
    return max(1, min(math.ceil(rate / TOKENS_PER_PROCESS_S), (os.cpu_count() or 1) // 3))


async def run_trace(base_url: str, trace: Sequence[TraceRequest], model_for: Callable[[TraceRequest], str],
                    vocab_size: int, api_key: str | None = None, request_timeout_s: float = 600,
                    progress: bool = True, seed: int = 0, processes: int | None = None) -> list[RequestRecord]:
    """Send every request of `trace` at its arrival time to POST {base_url}/v1/completions (greedy,
    ignore_eos, exactly output_len tokens, a prompt of prompt_len random token ids) and return one record
    per request, in trace order, once every request has ended. `processes`: client processes sharing the
    trace (None = auto_processes(trace); 1 = this event loop only)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
    if processes is not None and processes < 1:
        raise ValueError(f"processes must be >= 1 (or None for automatic), got {processes}")
    models = [model_for(r) for r in trace]  # a bad mapping fails here, before any load is sent
    records = [RequestRecord(r.index, r.adapter, r.prompt_len, r.output_len, r.arrival_s, model=m)
               for r, m in zip(trace, models)]
    jobs = list(zip(records, models))
    n_proc = min(processes or auto_processes(trace), max(1, len(trace)))
    bar = _Progress(len(trace), progress)
    refresher = asyncio.create_task(bar.refresh_forever())
    try:
        if n_proc == 1:
            async def now() -> float:
                return clock()

            await _run_shard(base_url, jobs, now, api_key, request_timeout_s, seed, vocab_size, bar.local)
        else:
            by_arrival = sorted(jobs, key=lambda j: j[0].arrival_s)
            shards = [by_arrival[k::n_proc] for k in range(n_proc)]
            await _run_sharded(base_url, shards, api_key, request_timeout_s, seed, vocab_size, bar)
    finally:
        refresher.cancel()
        bar.close()
    return records


# ---------------------------------------------------------------------------------------------------------
# Client shards: `python -m bench.client` reads one JSON job line on stdin, answers "ready", waits for
# "go <t0>", then writes "progress sent done failed tokens" lines twice a second and finally one
# "record <json>" line per request. JSON only: nothing executable crosses the pipe.
# ---------------------------------------------------------------------------------------------------------
_FIELDS = [f.name for f in dataclasses.fields(RequestRecord)]


async def _run_sharded(base_url: str, shards: list[list[tuple[RequestRecord, str]]], api_key: str | None,
                       timeout_s: float, seed: int, vocab_size: int, bar: _Progress) -> None:
    procs = []
    try:
        for k, shard in enumerate(shards):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.client", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                limit=1 << 24, env=child_env())
            job = {"base_url": base_url, "api_key": api_key, "timeout_s": timeout_s, "seed": seed,
                   "vocab_size": vocab_size, "requests": [[r.index, r.adapter, r.prompt_len, r.output_len, r.arrival_s, m]
                                                          for r, m in shard]}
            proc.stdin.write(json.dumps(job).encode() + b"\n")
            await proc.stdin.drain()
            procs.append(proc)
            bar.shards[k] = _Counts()
        async with asyncio.timeout(SHARD_START_TIMEOUT_S):
            for proc in procs:
                line = await proc.stdout.readline()
                if line.strip() != b"ready":
                    raise RuntimeError(f"a client process failed to start (said {line[:200]!r}, exit {proc.returncode})")
        t0 = clock() + 0.1  # every shard's time zero: the same instant on the host's monotonic clock
        for proc in procs:
            proc.stdin.write(f"go {t0!r}\n".encode())
            await proc.stdin.drain()
        await asyncio.gather(*(_collect(proc, shard, bar.shards[k]) for k, (proc, shard) in enumerate(zip(procs, shards))))
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def _collect(proc, shard: list[tuple[RequestRecord, str]], counts: _Counts) -> None:
    by_index = {rec.index: rec for rec, _ in shard}
    seen = set()
    while line := await proc.stdout.readline():
        kind, _, rest = line.decode().partition(" ")
        if kind == "progress":
            counts.sent, counts.done, counts.failed, counts.tokens = (int(v) for v in rest.split())
        elif kind == "record":
            values = dict(zip(_FIELDS, json.loads(rest)))
            rec = by_index[values["index"]]
            for name, value in values.items():
                setattr(rec, name, value)
            seen.add(rec.index)
    code = await proc.wait()
    for index, rec in by_index.items():
        if index not in seen:  # the shard died: its unreported requests are failures, not silence
            rec.error = rec.error or f"client process exited with code {code} before reporting this request"
    counts.done = len(by_index)
    counts.failed = sum(1 for rec in by_index.values() if rec.error is not None)


async def _shard_main() -> None:
    reader = asyncio.StreamReader(limit=1 << 28)
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    job = json.loads(await reader.readline())
    jobs = [(RequestRecord(i, a, p, o, t, model=m), m) for i, a, p, o, t, m in job["requests"]]
    out = sys.stdout
    counts = _Counts()
    reporter = None

    async def start() -> float:
        nonlocal reporter
        out.write("ready\n")
        out.flush()
        go = (await reader.readline()).split()
        if len(go) != 2 or go[0] != b"go":
            raise SystemExit(f"bench.client shard: expected 'go <t0>', got {go!r}")
        reporter = asyncio.create_task(report_forever())
        return float(go[1])

    async def report_forever() -> None:
        while True:
            await asyncio.sleep(0.5)
            out.write(f"progress {counts.sent} {counts.done} {counts.failed} {counts.tokens}\n")
            out.flush()

    await _run_shard(job["base_url"], jobs, start, job["api_key"], job["timeout_s"], job["seed"], job["vocab_size"], counts)
    reporter.cancel()
    for rec, _ in jobs:
        out.write("record " + json.dumps([getattr(rec, f) for f in _FIELDS]) + "\n")
    out.flush()


if __name__ == "__main__":
    asyncio.run(_shard_main())
