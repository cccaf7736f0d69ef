"""Everything one gateway process holds: model facts, tokenizer, keys, peer clients, metrics."""
from __future__ import annotations

import json
import time
from pathlib import Path

import zmq.asyncio

from services.gateway.auth import ApiKeys, Caller
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics
from services.gateway.scheduler_client import SchedulerClient
from services.gateway.store_client import StoreClient
from services.gateway.tokenizer import ModelTokenizer
from shared.log import get_logger
from shared.model_config import ModelConfig
from shared.wire import AdapterCard, AdapterList, GetAdapter, ListAdapters

TIERS_MAX_AGE_S = 2.0  # /metrics re-lists adapters at most this often
LOOKUP_TIMEOUT_S = 10.0  # an inference request waits at most this long for its adapter's card
CARD_TTL_S = 2.0  # resolved adapter names are reused this long (this gateway's own deletes drop them at once)


class GatewayState:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.log = get_logger("gateway")
        folder = Path(config.model_dir)
        self.model = ModelConfig.from_dir(folder)
        self.tokenizer = ModelTokenizer(folder)
        self.base_name = config.served_model_name or folder.resolve().name
        model_len = self.model.max_position_embeddings
        if config.max_model_len > model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {model_len} positions")
        self.max_model_len = config.max_model_len or model_len
        self.stop_token_ids = sorted(set(self.model.eos_token_ids) | generation_eos(folder))
        self.keys = ApiKeys.from_file(config.api_keys_file)
        self.ctx = zmq.asyncio.Context()
        self.scheduler = SchedulerClient(config.scheduler_addr, self.ctx, config.ping_interval_s, config.peer_timeout_s)
        self.store = StoreClient(config.store_addr, self.ctx, config.store_timeout_s, config.ping_interval_s)
        self.tiers = {"gpu": 0, "host": 0, "disk": 0}
        self.tiers_at = 0.0
        self.ready_cards: list[AdapterCard] = []  # the listing behind `tiers` (/v1/status names them)
        self.metrics = GatewayMetrics(self.scheduler.view, lambda: self.tiers, lambda: self.store.pong)
        self.draining = False
        self.inflight = 0  # inference requests between validation and their last byte
        self.metrics.in_flight.set_function(lambda: self.inflight)
        self.cards: dict[tuple[str, str], tuple[float, str]] = {}  # (tenant, name) -> (resolved at, adapter id)

    async def start(self) -> None:
        await self.scheduler.start()
        await self.store.start()
        self.log.info("gateway started", model=self.base_name, max_model_len=self.max_model_len,
                      auth=self.keys.enabled, scheduler=self.config.scheduler_addr, store=self.config.store_addr)

    async def close(self) -> None:
        await self.scheduler.close()
        await self.store.close()
        self.ctx.term()

    # ---- readiness -------------------------------------------------------------------------------

    def readiness(self) -> dict[str, bool]:
        within = self.config.peer_timeout_s
        pong = self.scheduler.view.pong
        return {
            "accepting": not self.draining,
            "scheduler": self.scheduler.view.fresh(within) and bool(pong and pong.ready),
            "adapter_store": self.store.fresh(within),
            "worker": self.scheduler.view.fresh(within) and bool(pong and pong.workers_ready > 0),
        }

    def check_serving(self) -> None:
        """503 before anything is queued when requests could not be served now."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", None, "shutting_down", retry_after=5)
        if not self.scheduler.view.fresh(self.config.peer_timeout_s):
            raise ApiError(503, "the scheduler is not available", None, "scheduler_unavailable", retry_after=1)

    # ---- models and adapters ---------------------------------------------------------------------

    async def resolve_model(self, name: str, caller: Caller) -> str | None:
        """Adapter id for `model`, None for the base model; 404 for anything else (never the base)."""
        if name == self.base_name:
            return None
        key = (caller.tenant, name)
        cached = self.cards.get(key)
        if cached is not None and time.monotonic() - cached[0] < CARD_TTL_S:
            return cached[1]
        try:
            card = await self.store.call(GetAdapter(name=name, tenant=caller.tenant), timeout_s=LOOKUP_TIMEOUT_S)
        except ApiError as e:
            if e.status in (400, 404):
                self.cards.pop(key, None)
                raise ApiError(404, f"the model {name!r} does not exist", "model", "model_not_found") from None
            raise
        if not isinstance(card, AdapterCard) or card.status != "ready":
            self.cards.pop(key, None)
            raise ApiError(404, f"the model {name!r} does not exist", "model", "model_not_found")
        if len(self.cards) > 10_000:
            self.cards.clear()
        self.cards[key] = (time.monotonic(), card.id)
        return card.id

    def forget_adapter(self, name: str) -> None:
        """After a delete or re-registration here, no request of this gateway may use the old card."""
        for key in [k for k in self.cards if k[1] == name]:
            del self.cards[key]

    def gpu_resident(self) -> set[str]:
        return {a for status in self.scheduler.view.workers.values() for a in status.resident_adapters}

    def residency(self, card: AdapterCard, gpu: set[str] | None = None) -> str:
        if card.id in (self.gpu_resident() if gpu is None else gpu):
            return "gpu"
        return "host" if card.host_resident else "disk"

    async def refresh_tiers(self) -> None:
        """Adapter counts per tier for /metrics and /v1/status; keeps the last figures if the store does not answer."""
        if time.monotonic() - self.tiers_at < TIERS_MAX_AGE_S:
            return
        try:
            listing = await self.store.call(ListAdapters(all_tenants=True), timeout_s=1.0)
        except ApiError:
            return
        if isinstance(listing, AdapterList):
            gpu = self.gpu_resident()
            cards = [c for c in listing.cards if c.status == "ready"]
            self.tiers = {"gpu": sum(c.id in gpu for c in cards), "host": sum(c.host_resident for c in cards),
                          "disk": len(cards)}
            self.ready_cards = cards
            self.tiers_at = time.monotonic()


def generation_eos(folder: Path) -> set[int]:
    """Extra end-of-turn ids some chat models list only in generation_config.json."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if isinstance(eos, int):
        return {eos}
    return {e for e in eos if isinstance(e, int)} if isinstance(eos, list) else set()
