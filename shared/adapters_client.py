"""`loraplex adapters add PATH... | ls | rm NAME...`: manage adapters on a running server over the REST API.

`add` uploads each adapter folder (adapter_config.json + adapter_model.safetensors) as a multipart form, a
few at a time, with a progress bar on stderr when there is more than one; `--server-path` registers folders
that already lie under the server's allow-listed root instead of uploading them. The server answers 201 for
a new adapter, 200 when the same name and content were already there, 409 for the same name with other
content; any failure is reported per adapter and makes the exit status 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_URL = "http://127.0.0.1:8000"


def error_message(response) -> str:
    """The `error.message` of an OpenAI-style error body, else the raw text."""
    try:
        return response.json()["error"]["message"]
    except Exception:
        return response.text.strip()[:500] or f"HTTP {response.status_code}"


class Progress:
    """`[#####.....] 12/40 adapter-011` redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, total: int, stream=sys.stderr, width: int = 30):
        self.total = total
        self.done = 0
        self.stream = stream
        self.width = width
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.lock = threading.Lock()

    def step(self, label: str) -> None:
        with self.lock:
            self.done += 1
            filled = self.width * self.done // max(1, self.total)
            line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {label}"
            self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
            if self.tty and self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()


def upload(client, folder: Path, name: str) -> tuple[int, dict | str]:
    files = {
        "adapter_config": (CONFIG_FILE, (folder / CONFIG_FILE).read_bytes(), "application/json"),
        "adapter_model": (WEIGHTS_FILE, (folder / WEIGHTS_FILE).read_bytes(), "application/octet-stream"),
    }
    r = client.post("/v1/adapters", data={"name": name}, files=files)
    return r.status_code, (r.json() if r.status_code in (200, 201) else error_message(r))


def register_path(client, path: str, name: str) -> tuple[int, dict | str]:
    r = client.post("/v1/adapters", json={"name": name, "path": path})
    return r.status_code, (r.json() if r.status_code in (200, 201) else error_message(r))


def cmd_add(client, args, out, err) -> int:
    if args.name and len(args.paths) > 1:
        err.write("--name applies to one adapter; give one PATH or let names come from folder names\n")
        return 2
    jobs = []
    for raw in args.paths:
        name = args.name or Path(raw.rstrip("/")).name
        if not args.server_path:
            folder = Path(raw)
            missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / f).is_file()]
            if missing:
                err.write(f"{raw}: not an adapter folder (missing {', '.join(missing)})\n")
                return 2
        jobs.append((raw, name))
    progress = Progress(len(jobs), err) if len(jobs) > 1 else None

    def one(job):
        raw, name = job
        try:
            result = register_path(client, raw, name) if args.server_path else upload(client, Path(raw), name)
        except Exception as e:  # connection refused, timeout: reported per adapter
            result = (0, f"{type(e).__name__}: {e}")
        if progress is not None:
            progress.step(name)
        return name, result

    failed = 0
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, jobs))
    for name, (status, body) in results:
        if status in (200, 201):
            what = "added" if status == 201 else "unchanged"
            out.write(f"{what:9} {name}  rank={body.get('rank')}  sha256={str(body.get('sha256', ''))[:12]}\n")
        else:
            failed += 1
            err.write(f"failed    {name}: {status or 'no answer'} {body}\n")
    return 1 if failed else 0


def cmd_ls(client, args, out, err) -> int:
    r = client.get("/v1/adapters")
    if r.status_code != 200:
        err.write(f"error: {r.status_code} {error_message(r)}\n")
        return 1
    cards = r.json().get("data", [])
    rows = [("NAME", "RANK", "RESIDENCY", "BYTES", "TARGETS")]
    rows += [(c["name"], str(c["rank"]), c.get("residency", ""), str(c["bytes"]), ",".join(c["target_modules"]))
             for c in sorted(cards, key=lambda c: c["name"])]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        out.write("  ".join(v.ljust(w) for v, w in zip(row, widths)) + "  " + row[4] + "\n")
    return 0


def cmd_rm(client, args, out, err) -> int:
    failed = 0
    for name in args.names:
        r = client.delete(f"/v1/adapters/{name}")
        if r.status_code == 204:
            out.write(f"removed   {name}\n")
        else:
            failed += 1
            err.write(f"failed    {name}: {r.status_code} {error_message(r)}\n")
    return 1 if failed else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplex adapters", description="Manage adapters on a running loraplex server.")
    p.add_argument("--url", default=os.environ.get("LORAPLEX_URL", DEFAULT_URL),
                   help=f"server base URL (env LORAPLEX_URL; default {DEFAULT_URL})")
    p.add_argument("--api-key", default=os.environ.get("LORAPLEX_API_KEY", ""),
                   help="admin key when the server has auth on (env LORAPLEX_API_KEY)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per HTTP call")
    sub = p.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add", help="register adapter folders (uploaded, or by server path)")
    add.add_argument("paths", nargs="+", metavar="PATH", help="adapter folder(s) with adapter_config.json and adapter_model.safetensors")
    add.add_argument("--name", help="name of the adapter (one PATH only; default: the folder name)")
    add.add_argument("--server-path", action="store_true", help="PATHs are folders on the server, under its allow-listed root")
    add.add_argument("--jobs", type=int, default=4, help="uploads in flight at once")
    sub.add_parser("ls", help="list adapters")
    rm = sub.add_parser("rm", help="delete adapters (requests in flight finish first)")
    rm.add_argument("names", nargs="+", metavar="NAME")
    return p


def main(argv: list[str] | None = None, out=None, err=None) -> int:
    import httpx

    out = out or sys.stdout
    err = err or sys.stderr
    args = parser().parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    commands = {"add": cmd_add, "ls": cmd_ls, "rm": cmd_rm}
    try:
        with httpx.Client(base_url=args.url, headers=headers, timeout=args.timeout) as client:
            return commands[args.action](client, args, out, err)
    except httpx.TransportError as e:
        err.write(f"cannot reach {args.url}: {e}\n")
        return 1
