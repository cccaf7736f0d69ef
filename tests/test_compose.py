"""docker-compose.yml runs exactly what `loraplex up` runs: no Docker engine here, so the file is parsed and
its commands are compared with the launcher's own, built for the compose topology."""
from __future__ import annotations

from pathlib import Path

import yaml

from services.launcher_commands import Topology, model_dir_of, service_commands
from services.launcher_config import LauncherConfig

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]

# Compose service -> launcher child of the same process.
CHILDREN = {"adapter_store": "adapter_store", "scheduler": "scheduler", "gpu_worker": "worker-0", "gateway": "gateway"}


def launcher_commands() -> dict[str, list[str]]:
    config = LauncherConfig(model="/model", device="cuda", host="0.0.0.0", port=8000, data_dir="/data",
                            redis_url="redis://redis:6379/0", allowed_root="/import")
    topology = Topology(
        redis_url=config.redis_url,
        store_bind="tcp://0.0.0.0:5560", store_addr="tcp://adapter_store:5560",
        scheduler_gateway_bind="tcp://0.0.0.0:5570", scheduler_gateway_addr="tcp://scheduler:5570",
        scheduler_worker_bind="tcp://0.0.0.0:5571", scheduler_worker_addr="tcp://scheduler:5571",
        data_dir="/data", model_dir=model_dir_of(config, Path("/data")), run_dir="/run/loraplex",
    )
    return service_commands(config, topology, "cuda", "bfloat16", 0)


def test_same_services_as_the_launcher():
    assert set(SERVICES) == {"redis", *CHILDREN}
    assert set(launcher_commands()) == set(CHILDREN.values())


def test_commands_match_the_launcher_exactly():
    expected = launcher_commands()
    for service, child in CHILDREN.items():
        assert SERVICES[service]["command"] == ["python", *expected[child]], service


def test_redis_keeps_an_fsynced_aof_on_a_named_volume():
    redis = SERVICES["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == "always"
    data = cmd[cmd.index("--dir") + 1]
    volume, _, mount = redis["volumes"][0].partition(":")
    assert mount == data and volume in COMPOSE["volumes"]


def test_worker_reserves_a_gpu_and_shares_the_store_arena():
    worker = SERVICES["gpu_worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert SERVICES["adapter_store"]["ipc"] == "shareable"
    assert worker["ipc"] == "service:adapter_store"
    # The healthcheck watches the same heartbeat file the worker is told to refresh.
    ready_file = worker["command"][worker["command"].index("--ready-file") + 1]
    assert ready_file in " ".join(worker["healthcheck"]["test"])


def test_dependencies_and_ports():
    assert SERVICES["adapter_store"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert set(SERVICES["gateway"]["depends_on"]) == {"adapter_store", "scheduler"}
    assert SERVICES["gateway"]["ports"] == ["8000:8000"]
    store_data = [v for v in SERVICES["adapter_store"]["volumes"] if v.endswith(":/data")]
    assert store_data and store_data[0].split(":")[0] in COMPOSE["volumes"]


def test_the_workers_compiled_kernels_live_on_a_named_volume():
    """Triton's cache directory is on a volume that outlives the container, so a restarted worker finds the
    kernel variants built before."""
    worker = SERVICES["gpu_worker"]
    cache = worker["environment"]["TRITON_CACHE_DIR"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in worker["volumes"]}
    assert mounts[cache] in COMPOSE["volumes"]
