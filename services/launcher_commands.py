"""The command line of every service, from the launcher's configuration and where things live.

One function per service, used by the launcher and checked against docker-compose.yml by a test: with the
compose topology (service host names, container paths) it must produce exactly the compose commands, so the
two ways of running loraplex cannot drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .launcher_config import LauncherConfig, service_extra


@dataclass(frozen=True)
class Topology:
    """Where each service listens, what others connect to, and the folders services use."""

    redis_url: str
    store_bind: str
    store_addr: str
    scheduler_gateway_bind: str
    scheduler_gateway_addr: str
    scheduler_worker_bind: str
    scheduler_worker_addr: str
    data_dir: str  # adapter blobs (data_dir/blobs)
    model_dir: str  # served model folder (or the dummy-weights config's folder)
    run_dir: str  # worker ready/heartbeat files


def model_dir_of(config: LauncherConfig, data_dir: Path) -> str:
    if config.model:
        return str(Path(config.model).resolve())
    if config.dummy_weights:
        path = Path(config.dummy_weights).resolve()
        return str(path if path.is_dir() else path.parent)
    return str(data_dir / "model")


def _argv(module: str, flags: dict[str, str], config: LauncherConfig, service: str) -> list[str]:
    argv = ["-m", module]
    for flag, value in flags.items():
        argv += [flag, value]
    for item in config.set:
        name, flag, value = service_extra(item)
        if name == service:
            argv += [flag, value]
    return argv


def store_command(config: LauncherConfig, t: Topology, dtype: str) -> list[str]:
    flags = {"--bind": t.store_bind, "--data-dir": t.data_dir, "--redis-url": t.redis_url,
             "--model-dir": t.model_dir, "--dtype": dtype, "--arena-bytes": str(config.arena_bytes)}
    if config.allowed_root:
        flags["--allowed-root"] = config.allowed_root
    return _argv("services.adapter_store", flags, config, "adapter_store")


def scheduler_command(config: LauncherConfig, t: Topology) -> list[str]:
    flags = {"--gateway-bind": t.scheduler_gateway_bind, "--worker-bind": t.scheduler_worker_bind,
             "--store-addr": t.store_addr, "--drain-timeout-s": f"{config.drain_timeout_s:g}",
             "--heartbeat-timeout-s": f"{config.heartbeat_timeout_s:g}"}
    argv = _argv("services.scheduler", flags, config, "scheduler")
    return argv + (["--log-json"] if config.log_json else [])


def worker_command(config: LauncherConfig, t: Topology, index: int, device: str, dtype: str, num_slots: int) -> list[str]:
    flags = {"--worker-id": f"worker-{index}"}
    if config.dummy_weights:
        flags["--dummy-weights"] = t.model_dir
    else:
        flags["--model"] = t.model_dir
    flags.update({
        "--scheduler-addr": t.scheduler_worker_addr, "--store-addr": t.store_addr,
        "--device": worker_device(device, index, config.tp), "--dtype": dtype, "--num-slots": str(num_slots),
        "--tp": str(config.tp), "--ready-file": str(Path(t.run_dir) / f"worker-{index}.ready"),
    })
    return _argv("services.gpu_worker", flags, config, "gpu_worker")


def gateway_command(config: LauncherConfig, t: Topology) -> list[str]:
    flags = {"--host": config.host, "--port": str(config.port), "--model-dir": t.model_dir,
             "--scheduler-addr": t.scheduler_gateway_addr, "--store-addr": t.store_addr,
             "--drain-timeout-s": f"{config.drain_timeout_s:g}"}
    if config.api_keys_file:
        flags["--api-keys-file"] = config.api_keys_file
    argv = _argv("services.gateway", flags, config, "gateway")
    return argv + (["--log-json"] if config.log_json else [])


def worker_device(device: str, index: int, tp: int) -> str:
    """Worker i's first GPU: workers take consecutive groups of `tp` GPUs; CPU workers share the CPU."""
    if device.startswith("cuda"):
        base = int(device.partition(":")[2] or 0)
        return f"cuda:{base + index * tp}"
    return device


def service_commands(config: LauncherConfig, t: Topology, device: str, dtype: str, num_slots: int) -> dict[str, list[str]]:
    """Every Python service's arguments after the interpreter, by child name, in start order."""
    commands = {"adapter_store": store_command(config, t, dtype), "scheduler": scheduler_command(config, t)}
    for i in range(config.workers):
        commands[f"worker-{i}"] = worker_command(config, t, i, device, dtype, num_slots)
    commands["gateway"] = gateway_command(config, t)
    return commands
