"""Rank 0's side of a tensor-parallel group: spawn the follower processes, wait for them with a timeout
while watching that they live, hand them each step plan, stop them.

Followers are plain subprocesses (`python -m services.gpu_worker.tp.follower SPEC_JSON`): the spec is JSON,
nothing is pickled. They exit on their own when rank 0 disappears, and rank 0 kills them at interpreter exit
if nobody stopped them.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import msgpack
import zmq

from shared.log import get_logger

from ..model import ForwardBatch
from .channel import LeaderChannel
from .plan import ERROR, INIT, STEP, STOP, AdapterLoad, encode_step
from .spec import FollowerSpec

log = get_logger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[3]


class TPRankError(RuntimeError):
    """A follower rank failed (at startup or during a step); the message names the rank and its error."""


class FollowerGroup:
    def __init__(self, size: int, spec: dict, cpu_threads: int | None = None):
        """`spec`: the FollowerSpec fields common to every rank (all but rank, size, parent_pid, channel and
        the store address, which this group fills in)."""
        import torch.distributed as dist

        self.size = size
        self.ctx = zmq.Context()
        self.channel = LeaderChannel(self.ctx)
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=spec.get("start_timeout_s", 300.0)))
        self.errors: dict[int, str] = {}
        self.procs: dict[int, subprocess.Popen] = {}
        self.plan_bytes = 0
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off: it fails on the machines we run on
        if cpu_threads is not None:
            # CPU ranks share the machine's cores; without this each would start one thread per core.
            env["OMP_NUM_THREADS"] = str(cpu_threads)
        atexit.register(self.kill)
        for rank in range(1, size):
            fs = FollowerSpec(rank=rank, size=size, parent_pid=os.getpid(), channel=self.channel.address,
                              store_host="127.0.0.1", store_port=self.store.port, **spec)
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "services.gpu_worker.tp.follower", fs.to_json()], env=env)
        log.info("tp.followers_spawned", size=size, pids=[p.pid for p in self.procs.values()])

    # ---- liveness and messages ------------------------------------------------------------------
    def _poll_messages(self, timeout_ms: int) -> list[tuple[int, bytes, list[bytes]]]:
        out = []
        msg = self.channel.recv(timeout_ms)
        while msg is not None:
            rank, kind, frames = msg
            if kind == ERROR:
                self.errors[rank] = frames[0].decode(errors="replace") if frames else "unknown error"
            out.append(msg)
            msg = self.channel.recv(0)
        return out

    def _raise_if_failed(self) -> None:
        self._poll_messages(0)
        for rank, proc in self.procs.items():
            code = proc.poll()
            if rank in self.errors or code is not None:
                if code is not None and rank not in self.errors:
                    # An exit without a report: give a report in flight a moment to arrive.
                    self._poll_messages(200)
                detail = self.errors.get(rank, "no error report")
                state = f"exited with code {code}" if code is not None else "failed"
                raise TPRankError(f"tensor-parallel rank {rank} {state}: {detail}")

    def wait_all(self, kind: bytes, timeout_s: float, what: str) -> None:
        """Wait until every follower sent `kind`, failing fast if one reports an error or dies."""
        pending = set(self.procs)
        deadline = time.monotonic() + timeout_s
        while pending:
            for rank, k, _ in self._poll_messages(100):
                if k == kind:
                    pending.discard(rank)
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise TPRankError(f"tensor-parallel ranks {sorted(pending)} not {what} after {timeout_s:.0f}s")

    def failure(self, exc: BaseException) -> BaseException:
        """The error to raise when a collective failed: a follower's own report if there is one."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self._raise_if_failed()
            except TPRankError as e:
                return e
            time.sleep(0.05)
        return exc

    # ---- plans ----------------------------------------------------------------------------------
    def send_init(self, **fields) -> None:
        header = msgpack.packb(fields)
        for rank in self.procs:
            self.channel.send(rank, INIT, header)

    def send_step(self, batch: ForwardBatch, loads: list[AdapterLoad]) -> None:
        self._raise_if_failed()
        header, frames, load_frames = encode_step(batch, loads)
        before = self.channel.bytes_sent
        for rank in self.procs:
            self.channel.send(rank, STEP, header, *frames, *[lf[rank] for lf in load_frames])
        self.plan_bytes = self.channel.bytes_sent - before

    # ---- shutdown -------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 10.0) -> None:
        for rank, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    self.channel.send(rank, STOP)
                except zmq.ZMQError:
                    pass  # never connected; killed below
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.channel.close()
        self.ctx.term()
        atexit.unregister(self.kill)

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
