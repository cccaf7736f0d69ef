"""The merge baseline (S-LoRA-merge): one adapter at a time, merged into the base weights.

The running batch holds requests of one adapter only, or of the base model only. Before the first request
of an adapter runs, W += s·B·A is applied to every adapted base weight; its requests then run as plain
base-model requests (no LoRA op at all). The merge is undone (W -= s·B·A) only when that batch has drained
and the oldest waiting request wants something else. A batch is a group, as in the PEFT baseline's queue:
when the batch drains, the oldest waiting request names the adapter, and every request of that adapter
waiting at that moment may join, ahead of older requests of other adapters. Requests that arrive later wait
for the next turn of their adapter, so the oldest request is never passed over for more than one batch.

The adapter's A and Bᵀ rows come from the pool, where the usual residency code loads them; the merge holds
one reference on it, so its rows stay put until the unmerge recomputes the same product from them.
"""
from __future__ import annotations

import torch

from shared.log import get_logger
from shared.model_config import MODULES

from .adapter_layout import chunks, layout_offsets
from .resident_adapters import Resident
from .weights import ModelWeights

log = get_logger(__name__)


class MergeMode:
    def __init__(self, engine, weights: ModelWeights):
        if getattr(engine, "tp_size", 1) > 1:
            raise ValueError("lora_mode=merge runs on one GPU only (tp must be 1)")
        self.engine = engine
        self.weights = weights
        self.current: str | None = None  # adapter merged into the weights now; None = the base model
        self._resident: Resident | None = None
        self.merges = 0
        self._group: set[str] = set()  # request ids that may join the running batch

    def admits(self, seq) -> bool:
        """Whether a waiting request may join the running batch: one of the group taken when it began."""
        return seq.req.request_id in self._group  # taken of the merged adapter's requests only

    def before_admission(self) -> None:
        """Once the running batch has drained, switch the weights to what the oldest waiting request needs and
        take its adapter's waiting requests as the next group. Requests whose adapter cannot be loaded fail
        here, as admission would fail them."""
        engine = self.engine
        while not engine.running and engine.waiting:
            wanted = engine.waiting[0].req.adapter
            if wanted != self.current:
                self.unmerge()
                if wanted is not None:
                    try:
                        self.merge(wanted)
                    except (KeyError, ValueError) as exc:
                        engine._fail(engine.waiting.popleft(), f"adapter {wanted!r} cannot be loaded: {exc}")
                        continue
            self._group = {s.req.request_id for s in engine.waiting if s.req.adapter == wanted}
            return

    def merge(self, name: str) -> None:
        res = self.engine.adapters.acquire(name)
        if res is None:
            raise ValueError(f"its rows do not fit in the pool ({self.engine.pool.num_slots} slots)")
        if self.engine.copier is not None:
            self.engine.copier.order_before_compute()  # the rows may still be on their way in
        self._apply(res, +1.0)
        self.current, self._resident = name, res
        self.merges += 1
        log.debug("engine.adapter_merged", adapter=name)

    def unmerge(self) -> None:
        if self._resident is None:
            return
        self._apply(self._resident, -1.0)
        self.engine.adapters.release(self._resident.name)
        log.debug("engine.adapter_unmerged", adapter=self.current)
        self.current, self._resident = None, None

    def deltas(self, res: Resident, layer: int) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """(base weight, first output row, s·B·A in fp32) of every module the adapter adapts in `layer`."""
        cfg, pool = self.engine.cfg, self.engine.pool
        width = pool.slot_width
        a_off, b_off, _ = layout_offsets(res.ranks, cfg, width)
        slots = torch.tensor(res.slots, dtype=torch.long, device=pool.device)
        lw = self.weights.layers[layer]
        targets = {"q_proj": (lw.qkv, 0), "k_proj": (lw.qkv, cfg.q_dim), "v_proj": (lw.qkv, cfg.q_dim + cfg.kv_dim),
                   "o_proj": (lw.o, 0), "gate_proj": (lw.gate_up, 0), "up_proj": (lw.gate_up, cfg.intermediate_size),
                   "down_proj": (lw.down, 0)}
        out = []
        for mi, m in enumerate(MODULES):
            r = res.ranks[mi]
            if r == 0:
                continue
            fan_in, fan_out = cfg.module_dims(m)
            ci, co = chunks(fan_in, width), chunks(fan_out, width)
            a = pool.k(layer)[slots[a_off[mi]: a_off[mi] + r * ci]].reshape(r, ci * width)[:, :fan_in]
            bt = pool.v(layer)[slots[b_off[mi]: b_off[mi] + r * co]].reshape(r, co * width)[:, :fan_out]
            weight, row0 = targets[m]
            out.append((weight, row0, bt.float().t() @ a.float()))  # Bᵀ rows carry the scale already
        return out

    @torch.inference_mode()
    def _apply(self, res: Resident, sign: float) -> None:
        for layer in range(self.engine.cfg.num_layers):
            for weight, row0, delta in self.deltas(res, layer):
                rows = weight[row0: row0 + delta.shape[0]]
                rows.copy_(rows.float().add_(delta, alpha=sign))
