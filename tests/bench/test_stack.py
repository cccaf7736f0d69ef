"""A stack per system: `loraplex up` (or the PEFT server) as a subprocess with the system's and policy's
flags, ready before use, adapters registered, and nothing of it left running after a stop or a crash."""
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from bench.adapters import generate_adapters
from bench.settings import get_setting
from bench.stack import POLICIES, Stack, StackConfig, adapter_slots, no_unify_slots
from bench.workload import TraceRequest
from shared.probes import alive, descendants
from tests.bench.infra import TINY, tiny_stack


def cmdline(pid: int) -> list[str]:
    try:
        return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def service_args(pids, module: str) -> list[str]:
    for pid in pids:
        args = cmdline(pid)
        if "-m" in args and args[args.index("-m") + 1] == module:
            return args
    raise AssertionError(f"no {module} process among {pids}")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def request(adapter):
    return TraceRequest(index=0, arrival_s=0.0, adapter=adapter, prompt_len=4, output_len=2)


@pytest.fixture(scope="module")
def population(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench-stack")
    return work, generate_adapters(TINY, work / "adapters" / "tiny-s0", 3, progress=False)


def test_stack_serves_its_system_and_policy_then_stops_leaving_nothing(population):
    import httpx

    work, pop = population
    stack = tiny_stack(work, pop, n=3, policy="lcfs").start()
    try:
        pids = descendants(stack.proc.pid)
        scheduler = service_args(pids, "services.scheduler")
        assert scheduler[scheduler.index("--queue-order") + 1] == "lcfs"
        assert scheduler[scheduler.index("--first-token-slo-s") + 1] == "0"
        assert stack.registration.complete and stack.registration.created == 3
        assert stack.base_model == TINY.model
        assert [stack.model_for(request(a)) for a in (None, 0, 2)] == [TINY.model, "adapter-00000", "adapter-00002"]
        with httpx.Client(base_url=stack.url, timeout=60) as c:
            r = c.post("/v1/completions", json={"model": stack.model_for(request(2)), "prompt": [3, 4], "max_tokens": 2,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
        store = service_args(pids, "services.adapter_store")
        store_pid = next(p for p in pids if cmdline(p) == store)
        assert Path(f"/dev/shm/loraplex-arena-{store_pid}").exists()
        all_pids = [stack.proc.pid, *pids]
    finally:
        stack.stop()
    assert [p for p in all_pids if alive(p)] == [] and stack.left_behind == []
    assert not Path(f"/dev/shm/loraplex-arena-{store_pid}").exists()
    assert not port_open(stack.port)


def test_a_killed_launcher_leaves_no_orphans_after_stop(population):
    work, pop = population
    stack = tiny_stack(work, pop, n=0).start()
    assert stack.registration is None  # no adapters asked for: nothing to register
    pids = [stack.proc.pid, *descendants(stack.proc.pid)]
    os.kill(stack.proc.pid, signal.SIGKILL)  # as a crashed launcher: no drain, no cleanup of its own
    stack.stop()
    deadline = time.monotonic() + 5
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if alive(p)] == []
    assert not any(Path(f"/dev/shm/loraplex-arena-{p}").exists() for p in pids)


def test_a_stack_that_cannot_start_says_why_and_leaves_nothing(population):
    work, pop = population
    stack = tiny_stack(work, pop, n=0, extra_set=("scheduler.queue_order=sideways",))
    with pytest.raises(RuntimeError, match="queue_order must be auto, deadline, fcfs or lcfs"):
        stack.start()
    assert stack.proc is None and stack.pids and [p for p in stack.pids if alive(p)] == []


def test_a_server_whose_http_port_was_taken_starts_again_on_another(population):
    """Another process binds the port the stack chose before its gateway does: the gateway exits with
    EXIT_ADDRESS_IN_USE, the launcher passes it on, and the stack starts again on a fresh port."""
    import httpx

    work, pop = population
    stack = tiny_stack(work, pop, n=1)
    taken = stack.port
    holder = socket.socket()
    holder.bind(("127.0.0.1", taken))
    holder.listen()
    try:
        stack.start()
        try:
            assert stack.port != taken and stack.registration.complete
            assert httpx.get(stack.url + "/ready", timeout=10).status_code == 200
            first_log = (work / "logs" / f"tiny-loraplex-{taken}.log").read_text()
            assert "address_in_use" in first_log and f"port={taken}" in first_log, first_log[-3000:]
        finally:
            stack.stop()
    finally:
        holder.close()
    assert [p for p in stack.pids if alive(p)] == []


def test_system_flags(population, tmp_path):
    work, pop = population

    def flags(system, **kw):
        return Stack(StackConfig(TINY, system, tmp_path, pop, n_adapters=2, **kw)).command()

    assert "worker.lora_mode=bmm" in flags("bmm") and "worker.lora_mode=merge" in flags("merge")
    assert not any("lora_mode" in a or "adapter_pool_slots" in a for a in flags("loraplex"))
    # tiny, rank 8 on q,k,v,o: 8 rows of A and of Bᵀ per module, each row one 64-wide slot.
    assert adapter_slots(TINY, 8) == 32
    assert f"worker.adapter_pool_slots={no_unify_slots(TINY, 10)}" in flags("no-unify", no_unify_adapters=10)
    assert no_unify_slots(TINY, 10) == 320 and no_unify_slots(TINY, 128, num_slots=4096) == 2048
    # By default the fixed adapter part fits a running batch of requests each on its own adapter of the
    # largest rank, not every resident row the engine could keep (4096 of those would outgrow the pool).
    assert no_unify_slots(get_setting("S2")) == 256 * adapter_slots(get_setting("S2"), 64) == 65536
    assert "scheduler.first_token_slo_s=6" in flags("loraplex", policy="early-abort")
    # Warm-up's decode graphs run the LoRA groups of the setting's target modules.
    assert f"worker.cuda_graph_lora_targets={','.join(TINY.targets)}" in flags("loraplex")
    assert all(m in ("q_proj", "k_proj", "v_proj", "o_proj") for m in TINY.targets)


def test_peft_stack_serves_exactly_its_adapters_from_a_view(population, tmp_path):
    work, pop = population
    stack = Stack(StackConfig(TINY, "peft", tmp_path, pop, n_adapters=2))
    argv = stack.command()
    assert argv[1:3] == ["-m", "bench.baselines.peft_server"]
    view = Path(argv[argv.index("--adapters-dir") + 1])
    assert sorted(p.name for p in view.iterdir()) == ["adapter-00000", "adapter-00001"]
    assert (view / "adapter-00001" / "adapter_config.json").read_text() == \
        (pop.root / "adapter-00001" / "adapter_config.json").read_text()


def test_bad_configurations_are_refused(population, tmp_path):
    work, pop = population
    with pytest.raises(ValueError, match="unknown system"):
        StackConfig(TINY, "vllm", tmp_path)
    with pytest.raises(ValueError, match="base-only runs on a loraplex stack"):
        StackConfig(TINY, "base-only", tmp_path)
    with pytest.raises(ValueError, match="unknown admission policy"):
        StackConfig(TINY, "loraplex", tmp_path, policy="random")
    with pytest.raises(ValueError, match="population has 3"):
        StackConfig(TINY, "loraplex", tmp_path, pop, n_adapters=4)


def test_peft_baseline_starts_serves_its_adapters_and_stops(population):
    import httpx

    work, pop = population
    stack = tiny_stack(work, pop, n=2, system="peft").start()
    try:
        assert stack.registration is None and stack.base_model == TINY.model
        pids = [stack.proc.pid, *descendants(stack.proc.pid)]
        with httpx.Client(base_url=stack.url, timeout=120) as c:
            models = {m["id"] for m in c.get("/v1/models").json()["data"]}
            assert models == {TINY.model, "adapter-00000", "adapter-00001"}
            r = c.post("/v1/completions", json={"model": stack.model_for(request(1)), "prompt": [3, 4, 5],
                                                "max_tokens": 2, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
    finally:
        stack.stop()
    assert [p for p in pids if alive(p)] == [] and not port_open(stack.port)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_admission_policy_is_a_scheduler_configuration(policy):
    from services.scheduler.config import SchedulerConfig

    values, argv = {}, []
    for item in POLICIES[policy]:  # given to the scheduler as flags, as the launcher's --set does
        key, value = item.removeprefix("scheduler.").split("=")
        values[key] = value
        argv += [f"--{key.replace('_', '-')}", value]
    config = SchedulerConfig.from_args(argv)
    assert config.queue_order == values["queue_order"]
    assert (config.first_token_slo_s > 0) == policy.startswith("early-abort")
