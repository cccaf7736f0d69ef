"""A benchmark plan runs its steps in order under one deadline, caps each, skips what no longer fits, and
records every outcome (real processes, real time)."""
from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench import REPO, child_env
from bench.driver import Driver, SweepSpec, adapters_in, check_only, expand, groups, selected
from bench.point import versions
from benchmarks.run_plan import MARGIN_S, load_plan


def run_plan(tmp_path: Path, plan: str, deadline_s: float, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    path = tmp_path / "plan.yaml"
    path.write_text(plan)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run_plan", str(path), "--out", str(out),
                           "--deadline-s", str(deadline_s), *extra], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    return proc, out


def outcomes(out: Path) -> dict[str, dict]:
    return {s["name"]: s for s in json.loads((out / "plan.json").read_text())["steps"]}


def test_steps_run_in_order_with_placeholders_and_a_failure_does_not_stop_the_rest(tmp_path):
    plan = """
steps:
  - name: first
    run: echo "started {since}" && echo one > {out}/a.txt
  - name: broken
    run: exit 3
  - name: third
    cap_s: 30
    run: >-
      cat {out}/a.txt && echo "budget {budget}" && echo "at {started}" &&
      echo '{"braces": 1}' | python3 -c 'import json,sys; print(json.load(sys.stdin))'
"""
    proc, out = run_plan(tmp_path, plan, 200, "--since", "2026-12-04T21:30")
    assert proc.returncode == 1, proc.stderr  # one step failed
    got = outcomes(out)
    recorded = json.loads((out / "plan.json").read_text())
    assert {k: recorded[k] for k in versions()} == versions() and recorded["server_code"]
    assert [got[n]["status"] for n in ("first", "broken", "third")] == ["done", "failed", "done"]
    assert got["broken"]["rc"] == 3 and got["third"]["rc"] == 0
    assert "started 2026-12-04T21:30" in (out / "first.log").read_text()
    third = (out / "third.log").read_text()
    # The third step ran after the first (it read its file); its budget is its 30 s cap less the margin.
    assert "one\n" in third and "budget 10\n" in third and "{'braces': 1}" in third
    # {started} is the step's own start, the one plan.json records, to the second.
    assert f"at {got['third']['started'].removesuffix('+00:00')}\n" in third
    assert "[2/3] broken: failed, rc 3" in proc.stderr and "[3/3] third: done, rc 0" in proc.stderr


def test_a_step_past_its_cap_is_cut_off_with_its_children_and_the_next_still_runs(tmp_path):
    plan = """
steps:
  - name: slow
    cap_s: 2
    run: sleep 60 & echo $! > {out}/child.pid; sleep 60
  - name: after
    run: echo fine
"""
    proc, out = run_plan(tmp_path, plan, 200)
    got = outcomes(out)
    assert got["slow"]["status"] == "cut off" and got["slow"]["rc"] is None
    assert 2 <= got["slow"]["seconds"] < 20
    assert got["after"]["status"] == "done"
    pid = int((out / "child.pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert proc.returncode == 1


def archived(archive: Path) -> dict[str, str]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def test_pack_leaves_one_archive_of_every_steps_files_read_by_later_steps_first(tmp_path):
    plan = """
steps:
  - name: first
    run: mkdir -p {out}/sweep && echo one > {out}/sweep/line.jsonl
  - name: second
    run: cat {out}/sweep/line.jsonl && echo two > {out}/b.json
"""
    proc, out = run_plan(tmp_path, plan, 200, "--pack")
    assert proc.returncode == 0, proc.stderr
    archive = out / "plan.tar.gz"  # named after the plan file
    assert [p.name for p in out.iterdir()] == ["plan.tar.gz"] and f"packed into {archive}" in proc.stderr
    files = archived(archive)
    assert sorted(files) == ["b.json", "first.log", "plan.json", "second.log", "sweep/line.jsonl"]
    assert "one\n" in files["second.log"]  # the second step read the first's file before the packing
    assert [s["status"] for s in json.loads(files["plan.json"])["steps"]] == ["done", "done"]


def test_a_plan_stopped_with_sigterm_packs_what_it_has_and_stops_its_step(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("""
steps:
  - name: quick
    run: echo fine > {out}/quick.txt
  - name: slow
    run: sleep 60 & echo $! > {out}/child.pid; echo waiting; sleep 60
""")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.run_plan", str(path), "--out", str(out),
                             "--deadline-s", "200", "--pack"], cwd=REPO, env=child_env(),
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    # Stopped once the slow step's child is up and its log says so.
    while not (out / "slow.log").exists() or "waiting" not in (out / "slow.log").read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    pid = int((out / "child.pid").read_text())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert [p.name for p in out.iterdir()] == ["plan.tar.gz"]
    files = archived(out / "plan.tar.gz")
    assert files["quick.txt"] == "fine\n" and "waiting" in files["slow.log"]
    assert [s["name"] for s in json.loads(files["plan.json"])["steps"]] == ["quick"]
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_steps_that_no_longer_fit_the_deadline_are_skipped_and_said_so(tmp_path):
    plan = """
steps:
  - name: quick
    run: echo ok
  - name: served
    min_s: 500
    run: echo never > {out}/served.txt
"""
    proc, out = run_plan(tmp_path, plan, 100)
    got = outcomes(out)
    assert got["quick"]["status"] == "done"
    assert got["served"]["status"] == "skipped" and "the step needs 500" in got["served"]["why"]
    assert not (out / "served.txt").exists() and not (out / "served.log").exists()
    assert "served: skipped" in proc.stderr


def test_a_step_for_another_gpu_is_skipped_and_said_so(tmp_path):
    # This host's first GPU, as the served points' lines name it ("cpu" without one).
    from bench.point import gpu_name

    here = gpu_name()
    plan = f"""
steps:
  - name: elsewhere
    gpu: NoSuchGPU-9000
    run: echo never > {{out}}/elsewhere.txt
  - name: here
    gpu: {here}
    run: echo ok > {{out}}/here.txt
"""
    proc, out = run_plan(tmp_path, plan, 100)
    got = outcomes(out)
    assert got["elsewhere"]["status"] == "skipped"
    assert got["elsewhere"]["why"] == f"needs a GPU named NoSuchGPU-9000; this host has {here}"
    assert not (out / "elsewhere.txt").exists() and not (out / "elsewhere.log").exists()
    assert got["here"]["status"] == "done" and (out / "here.txt").read_text() == "ok\n"


@pytest.mark.parametrize("plan, message", [
    ("steps: []", "non-empty list under 'steps'"),
    ("steps:\n  - name: a\n", "steps[0].run must be a command"),
    ("steps:\n  - name: a b\n    run: x\n", "steps[0].name must be letters"),
    ("steps:\n  - name: a\n    run: x\n  - name: a\n    run: y\n", "steps[1].name 'a' is used twice"),
    ("steps:\n  - name: a\n    run: x\n    cap_s: -1\n", "steps[0].cap_s must be a positive"),
    ("steps:\n  - name: a\n    run: x\n    timeout: 3\n", "unknown field(s) ['timeout']"),
    ("steps:\n  - name: a\n    run: x\n    gpu: ''\n", "steps[0].gpu must name a GPU"),
])
def test_a_malformed_plan_is_refused_naming_the_field(tmp_path, plan, message):
    path = tmp_path / "plan.yaml"
    path.write_text(plan)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_plan(path)


def test_a_plan_that_is_not_yaml_fails_before_any_step_runs(tmp_path):
    proc, out = run_plan(tmp_path, "steps:\n  - name: a\n    run: echo {\"x\": 1}\n", 100)
    assert proc.returncode == 2 and "plan.yaml" in proc.stderr and not out.exists()


def test_the_shipped_plans_parse_and_name_scripts_that_exist():
    for path in sorted((REPO / "benchmarks" / "plans").glob("*.yaml")):
        steps = load_plan(path)
        assert steps, path
        for step in steps:
            for word in step.run.split():
                if word.startswith(("benchmarks/", "bench/sweeps/", "tests/")):
                    assert (REPO / word).exists(), f"{path.name}: {step.name} names {word}"


def shipped_sweep_steps():
    """(plan path, step, sweep spec, --only filters) for every `bench sweep` a shipped plan's step runs."""
    for path in sorted((REPO / "benchmarks" / "plans").glob("*.yaml")):
        for step in load_plan(path):
            words = shlex.split(step.run.replace("{since}", "2026-12-04T00:00").replace("{budget}", "100"))
            for i, word in enumerate(words[:-2]):
                if word == "bench" and words[i + 1] == "sweep":
                    only = tuple(words[j + 1] for j, w in enumerate(words) if w == "--only")
                    yield path, step, SweepSpec.load(REPO / words[i + 2]), only


def test_the_shipped_plans_sweeps_select_points_of_their_specs():
    sweeps = 0
    for _, _, spec, only in shipped_sweep_steps():
        check_only(expand(spec), only)  # raises naming a filter that selects nothing
        sweeps += 1
    assert sweeps >= 4


def test_the_shipped_plans_copy_the_lines_their_sweeps_write():
    """A step that runs a sweep and then copies its lines to {out} must copy the file the sweep appends to
    (OUT_DIR/<spec name>.jsonl, OUT_DIR its --out-dir or docs/bench): a copy of another file returns nothing
    measured, found only after the device time is spent."""
    copies = 0
    for path in sorted((REPO / "benchmarks" / "plans").glob("*.yaml")):
        for step in load_plan(path):
            written = None  # a copy before any sweep of its own step copies nothing it measured
            for command in step.run.split(";"):
                words = shlex.split(command)
                if "sweep" in words and "bench" in words:
                    spec = SweepSpec.load(REPO / words[words.index("sweep") + 1])
                    out_dir = words[words.index("--out-dir") + 1] if "--out-dir" in words else "docs/bench"
                    written = f"{out_dir}/{spec.name}.jsonl"
                elif words[:1] == ["cp"] and words[-1].startswith("{out}"):
                    assert words[1] == written, f"{path.name}: {step.name} copies {words[1]}, its sweep writes {written}"
                    copies += 1
    assert copies >= 10


def test_the_shipped_plans_sweep_steps_are_given_a_budget_their_first_stack_fits(tmp_path):
    """A sweep step whose {budget} is below the driver's estimate for a fresh stack and its first point refuses
    to start at all (it did, on the GPU, with a cap of 300 s): the least budget a step can be handed, its cap or
    its min_s less the margins, must hold that estimate with a few seconds for the command's own start. A step
    after one that served the same setting's adapters on the same machine finds them registered and its start
    timed, so it is held to that warm estimate (a fresh one would keep a pair of 80 s points from one call)."""
    checked = warm = 0
    served: set[tuple] = set()
    for path, step, spec, only in shipped_sweep_steps():
        least = min(step.cap_s, step.min_s) - MARGIN_S - 5
        work = tmp_path / path.stem / step.name
        driver = Driver(spec, work, tmp_path / "none.jsonl", budget_s=least, only=only)
        (_, system, _, _), group = groups(selected(expand(spec), only))[0]
        population = (path.name, spec.setting, system, driver.population_dir().name)
        if population in served:  # as the earlier step of the plan left the machine
            driver.registry().mkdir(parents=True)
            driver.timings.note("registered", str(driver.registry()), float(adapters_in(group)))
            driver.timings.note("startup", driver.timing_key(system), spec.startup_s)
            warm += 1
        served.add(population)
        why = driver.stack_fits(system, group)
        assert not why, f"{path.name}: {step.name}: {why}"
        checked += 1
    assert warm >= 1
    assert checked >= 4
