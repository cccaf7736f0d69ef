"""The benchmark suite: S-LoRA's evaluation (workloads, load client, metrics, rooflines, baselines, plots)."""
from __future__ import annotations

import os
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment plus `extra`, for a Python child (a stack, a client shard, a measurement)
    that must import the repository's packages whatever its working directory."""
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def write_file_atomically(path: Path, text: str | None = None, write=None) -> None:
    """`path` appears whole or not at all, even while drivers on other GPUs of the host write it at once:
    each writes its own temporary (named by its process and thread) and renames it over `path`; the last
    rename wins, and every writer writes the same content. `write(tmp)` writes it when `text` is not given."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    if text is not None:
        tmp.write_text(text)
    else:
        write(tmp)
    tmp.replace(path)
