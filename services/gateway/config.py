"""Typed configuration of the gateway process; field docs become `--help`, unknown keys are rejected."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from shared.config import add_config_arguments, from_dict
from shared.config import doc_field as _doc




@dataclass
class GatewayConfig:
    """Settings of the HTTP gateway (OpenAI-compatible API, adapter management, health, metrics)."""

    host: str = _doc("address the HTTP server listens on", "127.0.0.1")
    port: int = _doc("HTTP port", 8000)
    model_dir: str = _doc("base model folder: config.json, tokenizer.json, tokenizer_config.json", "")
    served_model_name: str = _doc("name clients use for the base model; empty = the model folder's name", "")
    max_model_len: int = _doc("prompt + output tokens at most; 0 = the model's max_position_embeddings", 0)
    default_max_tokens: int = _doc("max_tokens of a completion that does not say (chat defaults to the rest of the context)", 16)
    scheduler_addr: str = _doc("ZeroMQ address of the scheduler's gateway socket", "tcp://127.0.0.1:5570")
    store_addr: str = _doc("ZeroMQ address of the adapter_store", "tcp://127.0.0.1:5560")
    api_keys_file: str = _doc('JSON file {"admin_keys": [...], "tenants": {"name": [keys]}}; empty = no auth', "")
    max_body_bytes: int = _doc("largest JSON request body accepted, bytes; larger -> 413", 8 * 2**20)
    max_upload_bytes: int = _doc("largest adapter upload accepted, bytes; larger -> 413", 512 * 2**20)
    store_timeout_s: float = _doc("how long an adapter_store call may take before 503", 60.0)
    ping_interval_s: float = _doc("how often the scheduler and store are pinged (readiness, metrics)", 0.5)
    peer_timeout_s: float = _doc("a scheduler or store silent this long is down: open requests fail with 503", 3.0)
    drain_timeout_s: float = _doc("on SIGTERM, time in-flight requests get to finish while new ones get 503", 30.0)
    keep_alive_s: int = _doc("seconds an idle client connection stays open; longer than clients' own pools keep "
                             "idle connections (httpx 5 s, most proxies 60 s), so that the client closes them: "
                             "a server that closes first can race a request being sent on the connection", 75)
    log_level: str = _doc("log level: debug, info, warning, error", "info")
    log_json: bool = _doc("log one JSON object per line", False)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_upload_bytes", "default_max_tokens", "keep_alive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if not 0 < self.port < 65536 and self.port != 0:
            raise ValueError(f"port must be in 1..65535, got {self.port}")

    @classmethod
    def from_dict(cls, values: dict) -> "GatewayConfig":
        return from_dict(cls, values)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "GatewayConfig":
        parser = argparse.ArgumentParser(prog="python -m services.gateway", description=cls.__doc__)
        add_config_arguments(parser, cls)
        config = cls(**vars(parser.parse_args(argv)))
        if not config.model_dir:
            parser.error("--model-dir is required")
        return config
