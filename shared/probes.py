"""Looking at a running stack from outside it: the process tree under a supervisor, a process's
memory and CPU time, and one sample of a Prometheus exposition. The launcher, the soak script, the bench
driver and the tests use these."""
from __future__ import annotations

import os
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may itself hold spaces and parentheses)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def service_pids(launcher_pid: int) -> dict[str, int]:
    """A running stack's processes by service (`gateway`, `scheduler`, `adapter_store`, `redis`, and each
    worker by its id), found among the launcher's descendants by their command lines."""
    out = {}
    for pid in descendants(launcher_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [c.decode(errors="replace") for c in cmd if c]
        if "-m" in args:
            module = args[args.index("-m") + 1]
            if module == "services.gpu_worker":
                out[args[args.index("--worker-id") + 1]] = pid
            elif module.startswith("services."):
                out[module.removeprefix("services.")] = pid
        elif args and "redis-server" in args[0]:
            out["redis"] = pid
    return out


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads) a process has used so far, or None if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float | None:
    """Resident memory in MiB, or None if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def metric_samples(text: str) -> list:
    """Every sample of a Prometheus text."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def metric_sum(samples: list, name: str, **labels) -> float:
    """Sum of every sample `name` whose labels include `labels` (0 when there is none)."""
    want = {k: str(v) for k, v in labels.items()}
    return sum(s.value for s in samples if s.name == name and want.items() <= s.labels.items())


def metric(text: str, name: str, **labels) -> float | None:
    """Value of the sample `name{labels}` (labels matched exactly, in any order) in Prometheus text, or None."""
    wanted = {k: str(v) for k, v in labels.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == wanted:
                return sample.value
    return None
