"""Adapter populations for a setting: n PEFT adapters on disk, and their bulk registration over the public API.

Writing n distinct weight sets is not always possible: Llama-2-7B adapters of rank 30 on q,k,v,o are about
63 MB each, so 2000 of them would be 126 GB, more than a GPU host's disk. `generate_adapters` writes
`distinct = min(n, cap)` weight sets, `cap` being how many fit in a byte budget (16 GB by default), and
gives every further name hard links to set `i % distinct` (a copy where links are impossible).

What that shares on the server, and what it does not (services/adapter_store):
- each name is its own adapter: its id is `name@sha256[:16]`, with its own registry entry (and refcount on
  its blob), its own rows in the host-RAM arena and its own slots in the GPU pool, loaded, evicted and
  counted like any other adapter. Serving cost is that of n distinct adapters.
- only the content-addressed blob file is shared (data_dir/blobs/<sha256>), so disk holds `distinct`
  blobs, and a name whose content is already stored costs no blob write when registered.
- ranks follow the weight sets: set k has a rank drawn (seeded by k) from the setting's rank set.

The folder is the population: a name whose folder is already complete is never rewritten, so a run that
stopped half way resumes, and a larger n later extends the same folder (names keep their content, which
the server's registry would otherwise refuse with 409). `population.json` records the setting, seed and
cap; a folder made for another setting or seed is refused.

Registration is by server path (`POST /v1/adapters {"name", "path"}`, the folder under the server's
`--allowed-root`), several at a time, skipping names the server already lists, with a deadline so that a
long registration can stop and continue in the next piece of a sweep.
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import write_file_atomically
from bench.settings import Setting

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
WRITER_THREADS = 8
MANIFEST = "population.json"
DEFAULT_BYTE_BUDGET = 16 * 10**9
DEFAULT_CONCURRENCY = 16
LORA_ALPHA = 16
# Transient refusals while the store works through a burst (its queue, a peer timeout): try again.
RETRY_STATUSES = (429, 502, 503, 504)
MAX_ATTEMPTS = 6


def adapter_name(i: int) -> str:
    return f"adapter-{i:05d}"


RANK_BLOCK = 4096
MAX_SETS = 1 << 20


@functools.lru_cache(maxsize=64)
def _rank_block(ranks: tuple[int, ...], seed: int, block: int) -> np.ndarray:
    # Fixed-size blocks, each from its own seed: set k's rank never depends on how many sets are drawn.
    return np.random.default_rng([seed, block]).choice(np.array(ranks), RANK_BLOCK)


def set_rank(setting: Setting, seed: int, k: int) -> int:
    """Rank of weight set k, drawn from the setting's rank set (seeded, independent of n)."""
    return int(_rank_block(setting.ranks, seed, k // RANK_BLOCK)[k % RANK_BLOCK])


def distinct_cap(setting: Setting, byte_budget: int, seed: int, limit: int = MAX_SETS) -> int:
    """How many leading weight sets (at most `limit`) fit in `byte_budget` bytes; at least one."""
    per_rank = {r: setting.adapter_bytes(r) for r in setting.ranks}
    total, k = 0, 0
    for block in range(-(-limit // RANK_BLOCK)):
        sizes = np.array([per_rank[int(r)] for r in _rank_block(setting.ranks, seed, block)], dtype=np.int64)
        sizes = sizes[:limit - block * RANK_BLOCK]
        cumulative = total + np.cumsum(sizes)
        fits = int(np.searchsorted(cumulative, byte_budget, side="right"))
        k += fits
        if fits < len(sizes):
            break
        total = int(cumulative[-1])
    return max(1, k)


@dataclass
class Population:
    setting: Setting
    root: Path
    names: list[str]
    ranks: list[int]  # per name
    distinct: int
    seed: int
    written: int = 0  # weight sets written by this call
    linked: int = 0  # names made of links by this call

    @property
    def complete(self) -> bool:
        return all(is_complete(self.root / name) for name in self.names)

    def set_of(self, i: int) -> int:
        return i % self.distinct

    @property
    def distinct_bytes(self) -> int:
        return sum(self.setting.adapter_bytes(r) for r in self.ranks[:self.distinct])


def is_complete(folder: Path) -> bool:
    return (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file()


def _manifest(root: Path, setting: Setting, seed: int, byte_budget: int) -> dict:
    """The population's identity; an existing folder keeps its cap (its linked names depend on it)."""
    path = root / MANIFEST
    if path.is_file():
        recorded = json.loads(path.read_text())
        if recorded.get("setting") != setting.name or recorded.get("seed") != seed:
            raise ValueError(f"{root} holds adapters of setting {recorded.get('setting')!r} seed {recorded.get('seed')}, "
                             f"not {setting.name!r} seed {seed}; use another folder")
        return recorded
    cap = distinct_cap(setting, byte_budget, seed)
    recorded = {"setting": setting.name, "seed": seed, "byte_budget": byte_budget, "cap": cap,
                "ranks": list(setting.ranks), "targets": list(setting.targets)}
    root.mkdir(parents=True, exist_ok=True)
    write_file_atomically(path, json.dumps(recorded, indent=2) + "\n")
    return recorded


def adapter_config(setting: Setting, rank: int) -> dict:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": setting.model,
        "inference_mode": True, "r": rank, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.0, "use_rslora": False,
        "target_modules": list(setting.targets), "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
        "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "init_lora_weights": True, "use_dora": False,
    }


def _write_set(setting: Setting, folder: Path, rank: int, seed: int, k: int) -> None:
    import torch
    from safetensors.torch import save_file

    from shared.make_adapters import random_adapter_tensors

    config = adapter_config(setting, rank)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + k)
    tensors = {key: t.to(torch.bfloat16) for key, t in
               random_adapter_tensors(config, setting.model_config, generator).items()}
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    _publish(tmp, folder)


def _link_set(source: Path, folder: Path) -> None:
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            os.link(source / name, tmp / name)
        except OSError:  # another file system, or links not allowed: a copy holds the same bytes
            shutil.copyfile(source / name, tmp / name)
    _publish(tmp, folder)


def _publish(tmp: Path, folder: Path) -> None:
    """Whole or absent: a crash never leaves a half-written adapter under its name. Another driver on the
    host may have published the same name meanwhile (same setting and seed, so the same content): keep its."""
    try:
        tmp.rename(folder)
    except OSError:
        if not is_complete(folder):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def generate_adapters(setting: Setting, root: str | Path, n: int, *, seed: int = 0,
                      byte_budget: int = DEFAULT_BYTE_BUDGET, progress: bool = True,
                      deadline: float | None = None) -> Population:
    """Make sure `root` holds adapters adapter-00000 .. adapter-{n-1} for the setting (see the module doc).

    Stops early (the result's `complete` is False) once `deadline` (time.monotonic()) has passed.
    """
    if n < 0:
        raise ValueError(f"number of adapters must be >= 0, got {n}")
    root = Path(root)
    recorded = _manifest(root, setting, seed, byte_budget)
    distinct = max(1, min(n, int(recorded["cap"])))
    ranks = [set_rank(setting, seed, i % distinct) for i in range(n)]
    names = [adapter_name(i) for i in range(n)]
    pop = Population(setting, root, names, ranks, distinct, seed)
    todo = [i for i in range(n) if not is_complete(root / names[i])]
    if not todo:
        return pop
    from tqdm import tqdm

    def late() -> bool:
        return deadline is not None and time.monotonic() > deadline

    with tqdm(total=len(todo), desc=f"{setting.name} adapters", unit="adapter", disable=not progress) as bar:
        def written() -> None:
            pop.written += 1
            bar.update(1)

        sets = [(i, root / names[i], ranks[i]) for i in todo if i < distinct]
        if not _write_sets(setting, seed, sets, late, written):
            return pop  # the deadline passed before every set was written
        # The linked names, once every set they point at is there.
        for i in todo:
            if i < distinct:
                continue
            if late():
                break
            _link_set(root / names[pop.set_of(i)], root / names[i])
            pop.linked += 1
            bar.update(1)
    return pop


def _write_sets(setting: Setting, seed: int, sets: list[tuple[int, Path, int]], late, written) -> bool:
    """Write weight sets (index, folder, rank) on several threads (drawing and writing gigabytes; torch and
    the safetensors writer let go of the GIL), each from its own seeded generator, so the bytes do not depend
    on the order; `written()` after each. False when `late()` stopped it before the last was started."""
    todo = iter(sets)
    with ThreadPoolExecutor(WRITER_THREADS) as writers:
        running: set = set()
        while True:
            while len(running) < 2 * WRITER_THREADS and not late():
                item = next(todo, None)
                if item is None:
                    break
                i, folder, rank = item
                running.add(writers.submit(_write_set, setting, folder, rank, seed, i))
            if not running:
                break
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                f.result()
                written()
    return next(todo, None) is None


# ---- registration ------------------------------------------------------------------------------------

@dataclass
class Registration:
    """Outcome of one bulk registration; `rate` is new registrations per second of this call."""

    requested: int
    created: int = 0
    already: int = 0  # listed before this call, or answered 200 (same name, same content)
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    stopped_at_deadline: bool = False

    @property
    def complete(self) -> bool:
        return not self.failed and not self.stopped_at_deadline and self.created + self.already == self.requested

    @property
    def rate(self) -> float:
        return self.created / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"requested": self.requested, "created": self.created, "already": self.already,
                "failed": len(self.failed), "seconds": round(self.seconds, 3), "per_s": round(self.rate, 3),
                "complete": self.complete}


def _error_text(response) -> str:
    try:
        return response.json()["error"]["message"]
    except Exception:
        return response.text[:300]


async def registered_names(client) -> set[str]:
    r = await client.get("/v1/adapters")
    if r.status_code != 200:
        raise RuntimeError(f"GET /v1/adapters answered {r.status_code}: {_error_text(r)}")
    return {card["name"] for card in r.json().get("data", [])}


async def register_adapters(base_url: str, root: str | Path, names: list[str], *,
                            concurrency: int = DEFAULT_CONCURRENCY, api_key: str | None = None,
                            progress: bool = True, deadline: float | None = None,
                            timeout_s: float = 600.0) -> Registration:
    """Register each name's folder under `root` by server path, `concurrency` at a time; names the server
    already lists are skipped (so a stopped registration resumes). `root` must lie under the server's
    --allowed-root. No new registration starts after `deadline` (time.monotonic())."""
    import httpx
    from tqdm import tqdm

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    root = Path(root).resolve()
    result = Registration(requested=len(names))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s) as client:
        listed = await registered_names(client)
        todo = [name for name in names if name not in listed]
        result.already = len(names) - len(todo)
        queue: asyncio.Queue[str] = asyncio.Queue()
        for name in todo:
            queue.put_nowait(name)
        bar = tqdm(total=len(todo), desc="register", unit="adapter", disable=not progress or not todo)

        async def one(name: str) -> None:
            body = {"name": name, "path": str(root / name)}
            message = ""
            for attempt in range(MAX_ATTEMPTS):
                try:
                    r = await client.post("/v1/adapters", json=body)
                except httpx.TransportError as e:
                    message = f"{type(e).__name__}: {e}"
                else:
                    if r.status_code == 201:
                        result.created += 1
                        return
                    if r.status_code == 200:
                        result.already += 1
                        return
                    message = f"{r.status_code} {_error_text(r)}"
                    if r.status_code not in RETRY_STATUSES:
                        break
                    retry_after = r.headers.get("retry-after")
                    if retry_after and retry_after.replace(".", "", 1).isdigit():
                        await asyncio.sleep(min(float(retry_after), 10.0))
                        continue
                await asyncio.sleep(min(0.5 * 2 ** attempt, 10.0))
            result.failed[name] = message

        async def worker() -> None:
            while not queue.empty():
                if deadline is not None and time.monotonic() > deadline:
                    result.stopped_at_deadline = True
                    return
                name = queue.get_nowait()
                await one(name)
                bar.update(1)
                bar.set_postfix(per_s=f"{result.created / max(1e-9, time.monotonic() - started):.1f}")

        try:
            await asyncio.gather(*(worker() for _ in range(min(concurrency, max(1, len(todo))))))
        finally:
            bar.close()
    result.seconds = time.monotonic() - started
    return result


def register(base_url: str, root: str | Path, names: list[str], **kw) -> Registration:
    """`register_adapters` from synchronous code."""
    return asyncio.run(register_adapters(base_url, root, names, **kw))
