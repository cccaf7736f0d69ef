"""The HF PEFT baseline server (the S-LoRA paper's PEFT baseline), speaking the gateway's HTTP subset.

    python -m bench.baselines.peft_server (--model DIR | --dummy-weights CONFIG_JSON_OR_DIR) \\
        --adapters-dir DIR --port P [--device cuda|cpu] [--dtype bfloat16|float32] [--max-batch 16]

A transformers causal LM wrapped by peft; every folder under --adapters-dir is an adapter named by the
folder. Requests queue; the GPU thread repeatedly takes the adapter of the oldest waiting request, up to
--max-batch waiting requests of that adapter, `set_adapter`, and runs them as one left-padded greedy batch
to completion (no continuous batching). Requests naming the base model run with adapters disabled.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

import torch

from bench.baselines.grouping import BatchLog, GroupingQueue
from bench.baselines.peft_http import PeftService, build_app
from bench.baselines.peft_model import (
    DTYPES, AdapterCache, GreedyRunner, build_base_model, index_adapters, load_hf_config,
)
from bench.baselines.peft_worker import BatchWorker
from services.gateway.state import generation_eos
from services.gateway.tokenizer import ModelTokenizer
from shared.log import configure_logging, get_logger

DEFAULT_MAX_LOADED = 128
GRACEFUL_SHUTDOWN_S = 10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.baselines.peft_server",
                                description="HF transformers + peft baseline server: requests grouped by adapter, "
                                            "set_adapter, padded greedy batches, no continuous batching.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hugging Face model folder (safetensors weights)")
    src.add_argument("--dummy-weights", metavar="CONFIG_JSON_OR_DIR",
                     help="random weights (seeded) built on the device from this config.json or model folder")
    p.add_argument("--adapters-dir", required=True, help="folder of PEFT adapter folders; folder name = adapter name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--max-batch", type=int, default=16, help="requests of one adapter per padded batch")
    p.add_argument("--max-loaded", type=int, default=DEFAULT_MAX_LOADED,
                   help="adapters held on the device at once; least recently used deleted beyond it")
    p.add_argument("--served-model-name", default="",
                   help="name of the base model in requests (default: the model or config folder's name)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="prompt + output tokens at most; 0 = the config's max_position_embeddings")
    p.add_argument("--default-max-tokens", type=int, default=16, help="max_tokens of a request that does not say")
    p.add_argument("--seed", type=int, default=0, help="seed of --dummy-weights")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    for name in ("max_batch", "max_loaded", "default_max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_model_len < 0:
        p.error(f"--max-model-len must be >= 0, got {args.max_model_len}")
    if not 0 < args.port < 65536:
        p.error(f"--port must be 1..65535, got {args.port}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    return args


def default_base_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    path = Path(args.model or args.dummy_weights).resolve()
    if path.is_file():
        return path.parent.name if path.name == "config.json" else path.stem
    return path.name


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def stop_token_ids(config, folder: Path | None) -> frozenset[int]:
    """EOS ids of the config and, as the gateway reads them, of generation_config.json (which often lists
    more, e.g. Llama-3's eot)."""
    ids = _ids(getattr(config, "eos_token_id", None))
    return frozenset(ids | generation_eos(folder)) if folder is not None else frozenset(ids)


def _gpu_memory(device: str):
    if not device.startswith("cuda"):
        return dict

    def read() -> dict:
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "peak_allocated": torch.cuda.max_memory_allocated()}
    return read


def build_service(args: argparse.Namespace, log) -> tuple[PeftService, AdapterCache, GreedyRunner]:
    adapters = index_adapters(args.adapters_dir)
    source = Path(args.model or args.dummy_weights)
    folder = source if source.is_dir() else None
    config = load_hf_config(source)
    base_name = default_base_name(args)
    if base_name in adapters:
        raise ValueError(f"an adapter folder is named {base_name!r}, the base model's name; rename it or "
                         "pass --served-model-name")
    started = time.monotonic()
    base = build_base_model(args.model, args.dummy_weights, args.device, DTYPES[args.dtype], args.seed)
    log.info("base model ready", model=base_name, device=args.device, dtype=args.dtype,
             dummy_weights=args.dummy_weights is not None, seconds=round(time.monotonic() - started, 2))

    cache = AdapterCache(base, adapters, args.max_loaded, args.device)
    preload = list(adapters)[: args.max_loaded]
    if preload:
        from tqdm import tqdm

        started = time.monotonic()
        for name in tqdm(preload, desc="loading adapters", unit="adapter", file=sys.stderr):
            cache.ensure(name)
        log.info("adapters loaded", loaded=len(preload), total=len(adapters), max_loaded=args.max_loaded,
                 seconds=round(time.monotonic() - started, 2))

    tokenizer = ModelTokenizer(folder) if folder is not None and (folder / "tokenizer.json").is_file() else None
    model_len = int(getattr(config, "max_position_embeddings", 0) or 0)
    if args.max_model_len and model_len and args.max_model_len > model_len:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's {model_len} positions")
    max_model_len = args.max_model_len or model_len
    if max_model_len < 2:
        raise ValueError("the config has no max_position_embeddings; pass --max-model-len")
    stops = stop_token_ids(config, folder)
    pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else min(stops, default=0)
    svc = PeftService(base_name=base_name, adapter_names=set(adapters), vocab_size=int(config.vocab_size),
                      max_model_len=max_model_len, stop_token_ids=stops, queue=GroupingQueue(args.max_batch),
                      batches=BatchLog(), tokenizer=tokenizer, default_max_tokens=args.default_max_tokens,
                      cache_stats=cache.stats, gpu_memory=_gpu_memory(args.device), log=log)
    return svc, cache, GreedyRunner(base, args.device, int(pad))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(level=args.log_level)
    log = get_logger("peft_baseline")
    try:
        svc, cache, runner = build_service(args, log)
    except ValueError as e:
        log.error("cannot start", error=str(e))
        return 2

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker = BatchWorker(svc.queue, cache, runner, svc.batches, asyncio.get_running_loop())
        svc.running = lambda: worker.running
        worker.start()
        log.info("peft baseline ready", host=args.host, port=args.port, model=svc.base_name,
                 adapters=len(svc.adapter_names), max_batch=args.max_batch, max_loaded=args.max_loaded)
        try:
            yield
        finally:
            for request in svc.queue.close():
                if not request.cancelled:
                    request.sink("the server shut down before this request ran")
            await asyncio.to_thread(worker.join, GRACEFUL_SHUTDOWN_S)

    import uvicorn

    from shared.ports import listen_socket

    app = build_app(svc, lifespan=lifespan)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    # Bound before serving, as the gateway does: a taken port exits with EXIT_ADDRESS_IN_USE, not 1.
    uvicorn.Server(config).run(sockets=[listen_socket(args.host, args.port, log)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
