"""`loraplex adapters add PATH... | ls | rm NAME...`: manage adapters on a running server over the REST API.

`add` uploads each adapter folder (adapter_config.json + adapter_model.safetensors) as a multipart form, a
few at a time, with a progress bar on stderr when there is more than one; `--server-path` registers folders
that already lie under the server's allow-listed root instead of uploading them. The server answers 201 for
a new adapter, 200 when the same name and content were already there, 409 for the same name with other
content. A bad adapter does not stop the others: each failure is printed as it happens, naming the file and
the problem (the server's own message), and the exit status is 2 when a PATH was not an adapter folder at
all, else 1 when any adapter failed, else 0.
"""
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_URL = "http://127.0.0.1:8000"
# The server names the part of an upload it refused by its form field; the user knows it by its file.
FIELD_FILES = {"adapter_config": CONFIG_FILE, "adapter_model": WEIGHTS_FILE}


def error_message(response) -> str:
    """The `error.message` of an OpenAI-style error body, else the raw text."""
    try:
        return response.json()["error"]["message"]
    except Exception:
        return response.text.strip()[:500] or f"HTTP {response.status_code}"


def error_param(response) -> str | None:
    try:
        return response.json()["error"]["param"]
    except Exception:
        return None


class Failure(Exception):
    """One adapter that could not be added: where the problem is (a file, or the folder) and what it is."""

    def __init__(self, where: str, problem: str, local: bool = False):
        super().__init__(f"{where}: {problem}")
        self.local = local  # the PATH is not an adapter folder: nothing was sent


def upload(client, folder: Path, name: str) -> tuple[int, dict]:
    files = {}
    for field, file_name in FIELD_FILES.items():
        path = folder / file_name
        try:
            data = path.read_bytes()
        except OSError as e:
            raise Failure(str(path), e.strerror or str(e)) from None
        files[field] = (file_name, data, "application/json" if field == "adapter_config" else "application/octet-stream")
    r = client.post("/v1/adapters", data={"name": name}, files=files)
    if r.status_code in (200, 201):
        return r.status_code, r.json()
    file_name = FIELD_FILES.get(error_param(r) or "")
    raise Failure(str(folder / file_name) if file_name else str(folder), f"{r.status_code} {error_message(r)}")


def register_path(client, path: str, name: str) -> tuple[int, dict]:
    r = client.post("/v1/adapters", json={"name": name, "path": path})
    if r.status_code in (200, 201):
        return r.status_code, r.json()
    raise Failure(f"{path} (on the server)", f"{r.status_code} {error_message(r)}")


def not_an_adapter_folder(folder: Path) -> Failure | None:
    if not folder.is_dir():
        return Failure(str(folder), "not an adapter folder (no such folder)", local=True)
    missing = [str(folder / f) for f in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / f).is_file()]
    if missing:
        return Failure(str(folder), f"not an adapter folder ({' and '.join(missing)} missing)", local=True)
    return None


def cmd_add(client, args, out, err) -> int:
    from tqdm import tqdm

    if args.name and len(args.paths) > 1:
        err.write("--name applies to one adapter; give one PATH or let names come from folder names\n")
        return 2
    if args.jobs < 1:
        err.write("--jobs must be at least 1\n")
        return 2
    jobs = [(raw, args.name or Path(raw.rstrip("/")).name) for raw in args.paths]

    def one(job) -> tuple[int, dict]:
        raw, name = job
        if args.server_path:
            return register_path(client, raw, name)
        problem = not_an_adapter_folder(Path(raw))
        if problem is not None:
            raise problem
        return upload(client, Path(raw), name)

    counts = {"added": 0, "unchanged": 0, "failed": 0}
    local_failures = 0
    bar = tqdm(total=len(jobs), file=err, unit="adapter", disable=len(jobs) < 2, dynamic_ncols=True, desc="adding")
    with bar, ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(one, job): job for job in jobs}
        for future in as_completed(futures):
            raw, name = futures[future]
            try:
                status, card = future.result()
            except Failure as e:
                counts["failed"] += 1
                local_failures += e.local
                bar.write(f"failed    {name}: {e}", file=err)
            except Exception as e:  # connection refused, timeout: reported per adapter
                counts["failed"] += 1
                bar.write(f"failed    {name}: {raw}: no answer from the server ({type(e).__name__}: {e})", file=err)
            else:
                what = "added" if status == 201 else "unchanged"
                counts[what] += 1
                bar.write(f"{what:9} {name}  rank={card.get('rank')}  sha256={str(card.get('sha256', ''))[:12]}", file=out)
            if counts["failed"]:
                bar.set_postfix(failed=counts["failed"], refresh=False)
            bar.update(1)
    if len(jobs) > 1:
        err.write(f"{counts['added']} added, {counts['unchanged']} unchanged, {counts['failed']} failed "
                  f"of {len(jobs)}\n")
    if local_failures:
        return 2
    return 1 if counts["failed"] else 0


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
