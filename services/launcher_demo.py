"""The embedded default's content: a tiny random model and a few demo adapters in the data dir.

Made once and reused on later starts (same data dir, same model, same adapters), so a restart serves the
same tokens. The adapters are registered through the public REST API like any user's would be;
registering the same content again is idempotent (200), so this runs on every start.
"""
from __future__ import annotations

from pathlib import Path

from shared.log import get_logger

log = get_logger("launcher")

DEMO_PREFIX = "demo"
DEMO_RANKS = (8, 16, 4, 32)


def prepare_demo(data_dir: Path, count: int) -> tuple[Path, list[Path]]:
    """The demo model folder and adapter folders, created if missing."""
    from shared.tiny_model import make_model

    model_dir = data_dir / "model"
    if not (model_dir / "config.json").is_file() or not (model_dir / "tokenizer.json").is_file():
        log.info("demo.make_model", dir=str(model_dir))
        make_model(model_dir, preset="tiny", seed=0)
    adapters_dir = data_dir / "demo-adapters"
    folders = sorted(p for p in adapters_dir.glob(f"{DEMO_PREFIX}-*") if (p / "adapter_model.safetensors").is_file())
    if len(folders) < count:
        from shared.make_adapters import make_adapters

        log.info("demo.make_adapters", dir=str(adapters_dir), count=count)
        folders = make_adapters(adapters_dir, model_dir, count, ranks=DEMO_RANKS, seed=0, prefix=DEMO_PREFIX)
    return model_dir, folders[:count]


def register_demo(base_url: str, folders: list[Path], headers: dict[str, str] | None = None) -> list[str]:
    """Register each demo adapter by upload; returns the names now registered."""
    import httpx

    names = []
    with httpx.Client(base_url=base_url, timeout=60.0, headers=headers or {}) as client:
        for folder in folders:
            files = {
                "adapter_config": ("adapter_config.json", (folder / "adapter_config.json").read_bytes(), "application/json"),
                "adapter_model": ("adapter_model.safetensors", (folder / "adapter_model.safetensors").read_bytes(),
                                  "application/octet-stream"),
            }
            r = client.post("/v1/adapters", data={"name": folder.name}, files=files)
            if r.status_code in (200, 201):
                names.append(folder.name)
            else:
                log.warning("demo.register_failed", adapter=folder.name, status=r.status_code, body=r.text[:500])
    return names
