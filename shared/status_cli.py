"""`loraplex status`: what the dashboard shows, as a terminal summary, from the server's GET /v1/status.

Readiness, request and token rates, latency percentiles, the queue, each worker's health and unified pool
(KV slots, adapter slots, free), adapters per tier (GPU pool, host RAM arena, disk) with the most requested
ones, and the totals since the gateway started. `--watch N` redraws every N seconds, `--json` prints the
document itself. Exit status: 0 when the server is ready, 1 when it is not or cannot be reached.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

DEFAULT_URL = "http://127.0.0.1:8000"
BAR_WIDTH = 32
TOP_ADAPTERS = 5  # per tier in the summary


class Style:
    """ANSI colours on a terminal (and not under NO_COLOR), plain text anywhere else."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.enabled else text

    def ok(self, text: str) -> str:
        return self(text, "32")

    def bad(self, text: str) -> str:
        return self(text, "31")

    def dim(self, text: str) -> str:
        return self(text, "2")

    def bold(self, text: str) -> str:
        return self(text, "1")


def fmt_int(n) -> str:
    return "-" if n is None else f"{int(n):,}"


def adapters_a_step(steps: dict) -> str:
    """Distinct adapters whose rows a mean decode step (graph-replayed or eager) read since the worker started:
    the part of a decode step that grows with the adapters served."""
    decode = [steps.get(kind, {}) for kind in ("graph", "decode")]
    count = sum(k.get("steps", 0) for k in decode)
    return f"{sum(k.get('adapters', 0) for k in decode) / count:.1f}" if count else "-"


def graphed(steps: dict) -> str:
    """Share of a worker's step time (since it started) in decode steps replayed from CUDA graphs: low under
    decode-heavy load means batches no graph covers, or a CPU worker."""
    total = sum(k["seconds"] for k in steps.values())
    return f"{steps.get('graph', {}).get('seconds', 0.0) / total:.0%}" if total else "-"


def fmt_ms(seconds) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1000
    return f"{ms / 1000:.1f} s" if ms >= 10_000 else f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def pool_bar(slots: dict, style: Style) -> str:
    """[####::::......] KV (#), adapter (:), free (.) in proportion to the pool."""
    total = slots["total"] or 1
    kv = round(BAR_WIDTH * slots["kv"] / total)
    adapter = round(BAR_WIDTH * slots["adapter"] / total)
    if slots["kv"] and not kv:
        kv = 1  # a pool in use never draws as empty
    if slots["adapter"] and not adapter:
        adapter = 1
    free = max(0, BAR_WIDTH - kv - adapter)
    return "[" + style("#" * kv, "34") + style(":" * adapter, "35") + style.dim("." * free) + "]"


def table(rows: list[list[str]], right: set[int]) -> list[str]:
    # Widths from the text without colour codes, so ANSI sequences do not skew the columns.
    plain = [[re.sub(r"\x1b\[[0-9;]*m", "", cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in plain) for i in range(len(rows[0]))]
    lines = []
    for row, bare in zip(rows, plain):
        cells = []
        for i, (cell, text) in enumerate(zip(row, bare)):
            pad = " " * (widths[i] - len(text))
            cells.append(pad + cell if i in right else cell + pad)
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def render(status: dict, url: str, style: Style) -> str:
    lines = []
    ready = style.ok("READY") if status["ready"] else style.bad("NOT READY")
    failing = [name for name, ok in status["checks"].items() if not ok]
    lines.append(f"{style.bold('loraplex')} at {url}  model {status['model']['name']!r}  {ready}"
                 + (f" ({', '.join(failing)})" if failing else "")
                 + style.dim(f"  up {int(status['uptime_s'])}s" + ("  auth on" if status["auth"] else "")))
    sched, store = status["scheduler"], status["adapter_store"]
    workers = status["workers"]
    healthy = sum(w["healthy"] for w in workers)
    up = lambda flag: style.ok("up") if flag else style.bad("down")  # noqa: E731
    lines.append(f"  scheduler {up(sched['up'])}   adapter store {up(store['up'])}   workers {healthy}/{len(workers)} healthy")
    lines.append("")

    t, lat, req = status["throughput"], status["latency"], status["requests"]
    lines.append(f"Traffic  (last {t['window_s']:g} s)   {t['requests_per_s']:.2f} req/s   {t['tokens_per_s']:.1f} tok/s"
                 f"   in flight {req['in_flight']}   queue {sched['queue_depth']}")
    ttft, tpot = lat["ttft"], lat["per_token"]
    lines.append(f"Latency  (last {lat['window_s']:g} s)   first token p50 {fmt_ms(ttft['p50_s'])}  p90 {fmt_ms(ttft['p90_s'])}"
                 f"  p99 {fmt_ms(ttft['p99_s'])}   per token p50 {fmt_ms(tpot['p50_s'])}  p90 {fmt_ms(tpot['p90_s'])}")
    by_status = ", ".join(f"{code}: {fmt_int(n)}" for code, n in sorted(req["by_status"].items()))
    lines.append(f"Totals   requests {fmt_int(req['total'])}" + (f" ({by_status})" if by_status else "")
                 + f"   tokens {fmt_int(req['generation_tokens'])} generated, {fmt_int(req['prompt_tokens'])} prompt"
                 + f"   refused {fmt_int(sum(req['rejections'].values()))}   aborted {fmt_int(sum(req['aborts'].values()))}")
    lines.append("")

    lines.append(style.bold("Workers") + style.dim("   pool: # KV slots  : adapter slots  . free"
                                                   "   graphed: step time in CUDA-graph decode steps"
                                                   "   read: adapters a decode step read"))
    if workers:
        rows = [["WORKER", "HEALTH", "RUNNING", "WAITING", "POOL", "KV", "ADAPTER", "FREE", "TOTAL", "ADAPTERS", "LOADS",
                 "PREEMPTED", "GRAPHED", "READ"]]
        for w in workers:
            health = style.ok("healthy") if w["healthy"] else style.bad("stale" if w["ready"] else "not ready")
            s = w["slots"]
            rows.append([w["id"], health, fmt_int(w["running"]), fmt_int(w["waiting"]), pool_bar(s, style),
                         fmt_int(s["kv"]), fmt_int(s["adapter"]), fmt_int(s["free"]), fmt_int(s["total"]),
                         fmt_int(w["resident_adapters"]), fmt_int(w["adapter_loads"]), fmt_int(w["preemptions"]),
                         graphed(w.get("steps") or {}), adapters_a_step(w.get("steps") or {})])
        lines += table(rows, right={2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13})
    else:
        lines.append("  no worker has reported yet")
    lines.append("")

    adapters = status["adapters"]
    tiers = adapters["tiers"]
    arena = store["arena"]
    lines.append(style.bold("Adapters") + f"   GPU pool {fmt_int(tiers['gpu'])}   host arena {fmt_int(tiers['host'])}"
                 f"   disk {fmt_int(tiers['disk'])} (registered)   base model {fmt_int(adapters['base_model_requests'])} req")
    if arena is not None:
        lines.append(f"  host arena: {fmt_bytes(arena['used_bytes'])} used of {fmt_bytes(arena['capacity_bytes'])}, "
                     f"{fmt_bytes(arena['pinned_bytes'])} pinned, {fmt_int(arena['adapters'])} adapters, {fmt_int(arena['pins'])} pins")
    labels = {"gpu": "on GPU", "host": "in host RAM only", "disk": "on disk only"}
    for tier in ("gpu", "host", "disk"):
        listed = adapters["by_residency"][tier]
        if not listed["count"]:
            continue
        shown = []
        for row in listed["adapters"][:TOP_ADAPTERS]:
            name = f"{row['tenant']}/{row['name']}" if row["tenant"] else row["name"]
            shown.append(f"{name} ({fmt_int(row['requests'])} req" + (f", {row['active']} now" if row["active"] else "") + ")")
        more = listed["count"] - len(shown)
        lines.append(f"  {labels[tier]:<17} {fmt_int(listed['count']):>6}   " + ", ".join(shown)
                     + (style.dim(f", +{fmt_int(more)} more") if more > 0 else ""))
    return "\n".join(lines) + "\n"


def fetch(client) -> dict:
    r = client.get("/v1/status")
    if r.status_code != 200:
        from shared.adapters_client import error_message

        raise RuntimeError(f"GET /v1/status: {r.status_code} {error_message(r)}")
    return r.json()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplex status", description="Summarize a running loraplex server: readiness, "
                                "traffic, latency, workers and their pools, adapters per tier.")
    p.add_argument("--url", default=os.environ.get("LORAPLEX_URL", DEFAULT_URL),
                   help=f"server base URL (env LORAPLEX_URL; default {DEFAULT_URL})")
    p.add_argument("--api-key", default=os.environ.get("LORAPLEX_API_KEY", ""),
                   help="admin key when the server has auth on (env LORAPLEX_API_KEY)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds for the HTTP call")
    p.add_argument("--json", action="store_true", help="print the status document as JSON")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS", help="redraw every SECONDS until Ctrl-C")
    return p


def main(argv: list[str] | None = None, out=None, err=None) -> int:
    import httpx

    out = out or sys.stdout
    err = err or sys.stderr
    args = parser().parse_args(argv)
    if args.watch < 0:
        err.write("--watch must be a positive number of seconds\n")
        return 2
    style = Style(hasattr(out, "isatty") and out.isatty() and not os.environ.get("NO_COLOR"))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/")
    with httpx.Client(base_url=url, headers=headers, timeout=args.timeout) as client:
        try:
            return _loop(client, args, url, style, out, err)
        except KeyboardInterrupt:  # the way out of --watch
            return 0


def _loop(client, args, url: str, style: Style, out, err) -> int:
    import httpx

    while True:
        try:
            status = fetch(client)
        except httpx.HTTPError as e:
            err.write(f"cannot reach {url}: {e}\n")
            code = 1
        except RuntimeError as e:
            err.write(f"{e}\n")
            code = 1
        else:
            text = json.dumps(status, indent=2) + "\n" if args.json else render(status, url, style)
            if args.watch and style.enabled:
                text = "\x1b[H\x1b[2J" + text  # redraw in place on a terminal
            out.write(text)
            out.flush()
            code = 0 if status["ready"] else 1
        if not args.watch:
            return code
        time.sleep(args.watch)
