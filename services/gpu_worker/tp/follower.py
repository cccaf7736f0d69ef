"""A follower rank: `python -m services.gpu_worker.tp.follower SPEC_JSON`.

1) load this rank's weight shard, report ready  2) join the collectives' process group  3) build the pool
shard and adapter tables at rank 0's sizes, report done  4) loop: apply each step plan's adapter loads, run
the same forward on this shard; stop on rank 0's word or when rank 0 is gone. Any failure is reported to rank
0 with its message before the process exits, so rank 0 can say which rank failed and why.
"""
from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import msgpack
import torch
import zmq

from shared.kernel_shapes import LaunchShapes
from shared.log import configure_logging, get_logger
from shared.model_config import MODULES

from ..kernels.launch_shapes import set_launch_shapes
from ..ops import select_backend
from ..ops.meta import LoraTables
from ..pool import UnifiedPool
from .channel import FollowerChannel
from .comm import TPComm
from .layout import TPLayout
from .model import TPLlamaModel
from .plan import ERROR, INIT, INIT_DONE, READY, STEP, STOP, LoadHeader, PlanError, decode_step
from .shard_weights import load_shard
from .spec import FollowerSpec, rank_device

log = get_logger("services.gpu_worker.tp.follower")  # not __main__ when run with -m
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
POLL_MS = 500


class RankZeroGone(RuntimeError):
    pass


class Follower:
    def __init__(self, spec: FollowerSpec, channel: FollowerChannel):
        self.spec = spec
        self.channel = channel
        self.config = spec.engine_config
        self.layout = TPLayout(spec.model_config, spec.size)
        self.device = rank_device(self.config.device, spec.rank)
        self.dtype = DTYPES[self.config.dtype]
        self.steps = 0

    def _recv(self, timeout_ms: int = POLL_MS):
        msg = self.channel.recv(timeout_ms)
        if msg is None and os.getppid() != self.spec.parent_pid:
            raise RankZeroGone("rank 0 exited")
        return msg

    def start(self) -> None:
        spec = self.spec
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # The leader's launch shapes in this rank's process too (the engine sets them in the leader's).
        set_launch_shapes(LaunchShapes.parse(self.config.kernel_shapes))
        self.weights = load_shard(spec.weights, self.layout, spec.rank, self.dtype, self.device)
        self.channel.send(READY)
        import torch.distributed as dist

        store = dist.TCPStore(spec.store_host, spec.store_port, spec.size, is_master=False,
                              timeout=timedelta(seconds=spec.start_timeout_s))
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", store=store, rank=spec.rank,
                                world_size=spec.size, timeout=timedelta(seconds=spec.collective_timeout_s))
        while True:
            msg = self._recv()
            if msg is None:
                continue
            kind, frames = msg
            if kind == STOP:
                raise RankZeroGone("rank 0 stopped the group during startup")
            if kind != INIT:
                raise PlanError(f"expected init from rank 0, got {kind!r}")
            break
        init = msgpack.unpackb(frames[0].bytes, raw=False)
        cfg = self.layout.cfg
        self.pool = UnifiedPool(cfg.num_layers, init["num_slots"], self.layout.slot_width, self.dtype, self.device)
        n, rows, width = len(MODULES), init["max_resident"], init["max_slots"]
        self.tables = LoraTables(
            slots=torch.zeros(rows, width, dtype=torch.int32, device=self.device),
            ranks=torch.zeros(rows, n, dtype=torch.int32, device=self.device),
            a_off=torch.zeros(rows, n, dtype=torch.int32, device=self.device),
            b_off=torch.zeros(rows, n, dtype=torch.int32, device=self.device),
        )
        ops = select_backend(self.device, spec.backend)
        comm = TPComm(spec.size, use_list_gather=self.device.type != "cuda")
        self.model = TPLlamaModel(self.layout, spec.rank, self.weights, ops, init["max_model_len"], comm)
        self.channel.send(INIT_DONE)
        log.info("tp.follower_ready", rank=spec.rank, size=spec.size, device=str(self.device),
                 num_slots=init["num_slots"], slot_width=self.layout.slot_width)

    def load_adapter(self, load: LoadHeader) -> None:
        need = load.rows.shape[2]
        if len(load.slots) != need or load.rows.shape[3] != self.layout.slot_width:
            raise PlanError(f"adapter {load.name!r}: {len(load.slots)} slots for rows of shape "
                            f"{list(load.rows.shape)} (slot width {self.layout.slot_width})")
        slots = torch.tensor(load.slots, dtype=torch.long, device=self.device)
        self.pool.write_adapter_rows(slots, load.rows.to(self.device))
        t, rid = self.tables, load.resident_id
        t.slots[rid, :need] = torch.tensor(load.slots, dtype=torch.int32)
        t.ranks[rid] = torch.tensor(load.ranks, dtype=torch.int32)
        t.a_off[rid] = torch.tensor(load.a_off, dtype=torch.int32)
        t.b_off[rid] = torch.tensor(load.b_off, dtype=torch.int32)

    def run(self) -> None:
        while True:
            msg = self._recv()
            if msg is None:
                continue
            kind, frames = msg
            if kind == STOP:
                return
            if kind != STEP:
                raise PlanError(f"unexpected message {kind!r} from rank 0")
            batch, loads = decode_step(frames[0].buffer, [f.buffer for f in frames[1:]], self.tables, self.device)
            for load in loads:
                self.load_adapter(load)
            self.model.forward(batch, self.pool)
            self.steps += 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = FollowerSpec.from_json(argv[0])
    configure_logging(level=spec.log_level)
    ctx = zmq.Context()
    channel = FollowerChannel(ctx, spec.channel, spec.rank)
    follower = Follower(spec, channel)
    code = 0
    try:
        follower.start()
        follower.run()
    except RankZeroGone as e:
        log.info("tp.follower_exit", rank=spec.rank, reason=str(e))
    except BaseException as e:  # report every failure to rank 0, then exit non-zero
        log.error("tp.follower_failed", rank=spec.rank, error=repr(e), steps=follower.steps)
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        try:
            channel.send(ERROR, detail.encode())
        except zmq.ZMQError:
            pass
        code = 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        channel.close()
        ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main())
