"""`loraplex bench run|sweep|plot|targets|roofline|adapters`: the S-LoRA evaluation, from one point to a whole sweep."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

WORK_DIR = Path("data") / "bench"  # git-ignored; shared by every sweep

DESCRIPTION = """Benchmarks of BENCHMARKS.md: the S-LoRA workload (Gamma arrivals, power-law adapter popularity,
uniform lengths) sent through the HTTP gateway of a stack started for one system, measured as one JSON
line per point (docs/bench/<sweep>.jsonl), each set against a roofline from ceilings measured in the same
run. Settings: S1, S2, S4, S-GQA (dummy weights of real shapes) and tiny (CPU tests). Systems: loraplex,
base-only, peft, merge, bmm, no-unify. Admission policies: early-abort (the server's default), fcfs, lcfs."""

COMMANDS_HELP = {
    "run": "measure one point: start a stack for the system (or use --url), send the trace, append its line",
    "sweep": "run a sweep spec (YAML) in pieces that end before --budget-s; run again to resume",
    "plot": "PNG figures from result files: throughput vs adapters, vs request rate, SLO attainment vs cv",
    "targets": "the serving targets from result files: measured, what the rooflines allow, verdict (markdown)",
    "roofline": "measure the ceilings here and print a setting's roofline throughput for a trace",
    "adapters": "write a setting's adapter population (and register it with a running server)",
}


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplex bench", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    run = sub.add_parser("run", help=COMMANDS_HELP["run"], description=COMMANDS_HELP["run"] + ". "
                         "The point is a one-point sweep: the same stack, adapters, roofline and line as `sweep`.")
    run.add_argument("--setting", required=True, help="S1, S2, S4, S-GQA or tiny")
    run.add_argument("--system", default="loraplex", help="loraplex, base-only, peft, merge, bmm or no-unify")
    run.add_argument("--n", type=int, default=100, help="number of adapters (0 = base model only)")
    run.add_argument("--rate", type=float, required=True, help="request rate R (req/s); above capacity = saturation")
    run.add_argument("--cv", type=float, default=1.0, help="burstiness of arrivals (Gamma cv)")
    run.add_argument("--alpha", type=float, default=1.0, help="adapter popularity power law (1 = uniform)")
    run.add_argument("--policy", default="early-abort", help="admission policy: early-abort, fcfs or lcfs")
    run.add_argument("--duration-s", type=float, default=120.0, help="arrivals span this many seconds")
    run.add_argument("--warmup-s", type=float, default=20.0, help="requests arriving earlier are not measured")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--url", help="measure the server already running here instead of starting one (its adapters "
                     "must be named adapter-00000...; nothing is registered)")
    run.add_argument("--out", default="docs/bench/runs.jsonl", help="results file the line is appended to")
    _stack_arguments(run)

    sweep = sub.add_parser("sweep", help=COMMANDS_HELP["sweep"], description=(
        "Run the points of a sweep spec (bench/sweeps/*.yaml) that are not yet in OUT_DIR/<name>.jsonl, starting "
        "one stack per (setting, system, n, policy), and stop before --budget-s seconds (startup included): a "
        "stack or point that would not fit is left for the next piece. Exit 0 when the sweep is complete, 3 when "
        "more pieces are needed (run the same command again), 1 on an error."))
    sweep.add_argument("spec", help="sweep spec (YAML)")
    sweep.add_argument("--budget-s", type=float, default=540.0,
                       help="wall time of this piece, stack startups included (default 540: under 10 minutes)")
    sweep.add_argument("--work-dir", type=Path, default=WORK_DIR,
                       help="adapters, stack data, logs, timings, shared by every sweep (default %(default)s)")
    sweep.add_argument("--out-dir", default="docs/bench", help="results folder (default docs/bench)")
    sweep.add_argument("--dry-run", action="store_true", help="list the points and stacks still to run, run nothing")
    sweep.add_argument("--since", default="", metavar="ISO_TIME",
                       help="measure again every point whose line started before this time (UTC, e.g. "
                            "2026-11-29T18:40); the older lines stay in the file, the latest line of a point wins")
    sweep.add_argument("--only", action="append", default=[], metavar="TEXT",
                       help="run only the points whose key contains TEXT (e.g. /n=5/ or base-only; repeat for any "
                            "of several); the others stay as they are")
    sweep.add_argument("--quiet", action="store_true", help="no progress bars")
    sweep.add_argument("--gpus", default="1", metavar="N|I,J,..",
                       help="spread the points over this many GPUs of the host (or these GPU ids, so that other "
                            "sweeps can run on the rest), a driver per GPU (bench/lanes.py)")
    sweep.add_argument("--gpu", type=int, default=None, help="run on this GPU only, as lane gpuI (its own "
                       "registry and blobs); set by --gpus for each lane")
    sweep.add_argument("--shard", default="", metavar="I/N",
                       help="take every N-th point still to run, from the I-th (set by --gpus for each lane)")
    sweep.add_argument("--run", default="", metavar="ID",
                       help="the run id its lines carry (default: this command's start time; set by --gpus for "
                            "each lane, so that every lane's lines name one run)")

    plot = sub.add_parser("plot", help=COMMANDS_HELP["plot"], description=COMMANDS_HELP["plot"] + ".")
    plot.add_argument("files", nargs="*", help="result files (default docs/bench/*.jsonl)")
    plot.add_argument("--out-dir", help="where PNGs go (default: next to each file)")

    targets = sub.add_parser("targets", help=COMMANDS_HELP["targets"], description=COMMANDS_HELP["targets"] + (
        ". Each point is its latest saturation line (cv 1, alpha 1, early abort, highest rate); a ratio target "
        "beside the ratio of its points' rooflines, which no faster server can pass (bench/targets.py)."))
    targets.add_argument("files", nargs="*", help="result files (default docs/bench/*.jsonl)")
    targets.add_argument("--gpu", default="H200", help="judge the lines measured on this GPU, matched within the "
                         "line's device name (default H200, the GPU the targets are set for)")
    targets.add_argument("--plot", metavar="PNG", help="also draw each target's measured share of what it asks "
                         "beside the most its rooflines allow (bench/targets_plot.py)")

    roof = sub.add_parser("roofline", help=COMMANDS_HELP["roofline"], description=(
        "Measure device-to-device copy, bf16 matmul and pinned host-to-device ceilings, then print the roofline "
        "throughput of the setting's trace (see bench/roofline.py for the model)."))
    roof.add_argument("--setting", default="S2")
    roof.add_argument("--device", default="", help="cuda or cpu (default: cuda when visible)")
    roof.add_argument("--n", type=int, default=100, help="number of adapters (0 = base model only)")
    roof.add_argument("--rate", type=float, default=10.0)
    roof.add_argument("--duration-s", type=float, default=120.0)
    roof.add_argument("--batch", type=int, default=256, help="running batch the weights are amortised over")
    roof.add_argument("--seed", type=int, default=0)
    roof.add_argument("--hbm-gbs", type=float, default=0.0,
                      help="copy ceiling in GB/s (read + written) to use instead of measuring; needs --matmul-tflops")
    roof.add_argument("--matmul-tflops", type=float, default=0.0,
                      help="bf16 matmul ceiling in TFLOP/s to use instead of measuring; needs --hbm-gbs")
    roof.add_argument("--json", action="store_true", help="one JSON object instead of text")

    ad = sub.add_parser("adapters", help=COMMANDS_HELP["adapters"], description=(
        "Write N PEFT adapters for a setting (bf16, ranks drawn from its rank set): distinct weight sets up to "
        "--budget-gb, further names as hard links to them (see bench/adapters.py). With --url, register them by "
        "server path (DIR must be under the server's --allowed-root), skipping names already registered."))
    ad.add_argument("setting", help="S1, S2, S4, S-GQA or tiny")
    ad.add_argument("--n", type=int, required=True, help="number of adapters")
    ad.add_argument("--dir", required=True, help="population folder")
    ad.add_argument("--budget-gb", type=float, default=16.0, help="bytes of distinct weight sets at most (GB)")
    ad.add_argument("--seed", type=int, default=0)
    ad.add_argument("--url", help="register them with this server")
    ad.add_argument("--concurrency", type=int, default=16, help="registrations in flight at once")
    ad.add_argument("--api-key", default="", help="admin key when the server has auth on")
    return p


def _stack_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="", help="cuda or cpu (default: cuda when visible)")
    p.add_argument("--arena-gb", type=float, default=0.0, help="host-RAM adapter cache (GiB; 0 = launcher default)")
    p.add_argument("--num-slots", type=int, default=0, help="pool slots (0 = from GPU memory)")
    p.add_argument("--set", action="append", default=[], metavar="SERVICE.FLAG=VALUE", help="extra stack flag")
    p.add_argument("--work-dir", type=Path, default=WORK_DIR,
                   help="adapters, stack data, logs, shared by every sweep (default %(default)s)")


def gpus_of(text: str) -> list[int]:
    """`--gpus`: a count N (GPUs 0..N-1) or a list of GPU ids `I,J,..`."""
    try:
        ids = [int(x) for x in text.split(",")] if "," in text else list(range(int(text)))
    except ValueError:
        raise ValueError(f"--gpus {text!r} is neither a count nor a list of GPU ids such as 2,3") from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"--gpus {text!r}: need at least one GPU, ids >= 0, none twice")
    return ids


def _command(argv: list[str]) -> str:
    return shlex.join(["loraplex", "bench", *argv])


def cmd_sweep(args, argv) -> int:
    from bench.driver import (MORE_PIECES, Driver, SweepSpec, check_only, done_keys, expand, groups, point_key,
                              selected, shard_of)

    spec = SweepSpec.load(args.spec)
    check_only(expand(spec), tuple(args.only))
    results = Path(args.out_dir) / f"{spec.name}.jsonl"
    if args.since:
        try:
            datetime.datetime.fromisoformat(args.since)
        except ValueError:
            raise SystemExit(f"loraplex bench sweep: --since {args.since!r} is not an ISO time such as "
                             "2026-11-29T18:40") from None
    if args.dry_run:
        done = done_keys(results, args.since)
        for key, group in groups(selected(expand(spec), tuple(args.only))):
            todo = [p for p in group if point_key(p) not in done]
            sys.stdout.write(f"stack {'/'.join(str(k) for k in key)}: {len(group) - len(todo)} done, {len(todo)} to run\n")
            for p in todo:
                sys.stdout.write(f"  {point_key(p)}\n")
        return 0
    gpu_ids = gpus_of(args.gpus)
    spread = len(gpu_ids) > 1 or "," in args.gpus
    if spread and (args.gpu is not None or args.shard):
        raise ValueError("--gpus starts the lanes itself: give it without --gpu and --shard")
    shard = shard_of(args.shard) if args.shard else (0, 1)
    lane = ""
    if args.gpu is not None:
        if args.gpu < 0:
            raise ValueError(f"--gpu must be >= 0, got {args.gpu}")
        os.environ["CUDA_VISIBLE_DEVICES"] = str(args.gpu)  # before anything here or in a child touches CUDA
        lane = f"gpu{args.gpu}"
    _unwind_on_sigterm()
    driver = Driver(spec, args.work_dir, results, args.budget_s, _command(argv), progress=not args.quiet,
                    since=args.since, lane=lane, shard=shard, only=tuple(args.only), run=args.run)
    if spread:
        from bench.lanes import sweep_on_gpus

        return sweep_on_gpus(driver, args.spec, gpu_ids, args.work_dir, args.out_dir, args.since, args.quiet)
    result = driver.run_piece()
    sys.stdout.write(f"{spec.name}: {len(result.ran)} points measured in this piece, "
                     f"{result.total - result.remaining} of {result.total} in {results}\n")
    if result.complete:
        return 0
    sys.stdout.write(f"stopped: {result.stopped_for or 'budget'}; run the same command again to continue\n")
    return MORE_PIECES


def cmd_run(args, argv) -> int:
    from bench.driver import Driver, SweepSpec

    out = Path(args.out)
    spec = SweepSpec(name=out.stem, setting=args.setting, systems=[args.system], n=[args.n], rates=[args.rate],
                     cvs=[args.cv], alphas=[args.alpha], policies=[args.policy], duration_s=args.duration_s,
                     warmup_s=args.warmup_s, seed=args.seed, device=args.device, arena_gb=args.arena_gb,
                     num_slots=args.num_slots, set=args.set)
    _unwind_on_sigterm()
    driver = Driver(spec, args.work_dir, out, float("inf"), _command(argv))
    if args.url:
        return _run_against(driver, args.url)
    result = driver.run_piece()
    if not result.ran and result.remaining:
        sys.stderr.write(f"the point did not run: {result.stopped_for}\n")
        return 1
    sys.stdout.write(f"{'measured' if result.ran else 'already in'} {out}\n")
    return 0


def _run_against(driver, url: str) -> int:
    """One point against a server someone else started: adapter i is `adapter-0000i`, None the base."""
    from bench.adapters import adapter_name
    from bench.driver import (
        append_line, expand, measure_ceilings_apart, point_key, point_model_for, pool_total_slots, summary,
    )
    from bench.point import run_point
    from bench.stack import base_model

    p = expand(driver.spec)[0]
    base = base_model(url, driver.setting.model)
    model_for = point_model_for(p, base, lambda r: base if r.adapter is None else adapter_name(r.adapter))

    ceilings = measure_ceilings_apart(driver.spec.device)
    line = run_point(url, p, model_for, driver.setting.vocab_size, command=driver.command)
    line.update(key=point_key(p), sweep=driver.spec.name, stack_command=None)
    line.update(driver.roofline_fields(p, line, ceilings, pool_total_slots(url), None))
    append_line(driver.results, line)
    sys.stdout.write(summary(line) + "\n")
    return 0


def cmd_plot(args, argv) -> int:
    from bench.plots import plot_all

    files = args.files or sorted(str(p) for p in Path("docs/bench").glob("*.jsonl"))
    if not files:
        sys.stderr.write("no result files given and none in docs/bench/\n")
        return 1
    written = plot_all(files, args.out_dir)
    for path, panels in written.items():
        lines = sum(len(series) for series in panels.values())
        sys.stdout.write(f"wrote {path} ({lines} lines)\n")
    if not written:
        sys.stdout.write("no figure: no series with two points or more\n")
    return 0


def cmd_targets(args, argv) -> int:
    from bench.targets import table

    files = args.files or sorted(str(p) for p in Path("docs/bench").glob("*.jsonl"))
    if not files:
        sys.stderr.write("no result files given and none in docs/bench/\n")
        return 1
    sys.stdout.write(table(files, args.gpu))
    if args.plot:
        from bench.targets_plot import plot_targets

        drawn = plot_targets(files, args.plot, args.gpu)
        sys.stdout.write(f"{args.plot}: {len(drawn)} targets drawn\n" if drawn else "no figure: no target measured\n")
    return 0


def cmd_roofline(args, argv) -> int:
    from bench.roofline import Ceilings, attainable_rps, held, roofline_rps
    from bench.driver import measure_ceilings_apart
    from bench.settings import get_setting
    from bench.workload import make_trace

    setting = get_setting(args.setting)
    if (args.hbm_gbs > 0) != (args.matmul_tflops > 0):
        sys.stderr.write("--hbm-gbs and --matmul-tflops go together (ceilings measured elsewhere, e.g. a result "
                         "line's `ceilings`)\n")
        return 2
    if args.hbm_gbs > 0:
        ceilings = Ceilings(device="cuda", name="given", hbm_gbs=args.hbm_gbs, matmul_tflops=args.matmul_tflops,
                            h2d_gbs=0.0, copy_bytes=0, matmul_n=0, matmul_dtype="bfloat16", pinned=False)
    else:
        ceilings = Ceilings(**measure_ceilings_apart(args.device))
    trace = make_trace(args.n, 1.0, args.rate, 1.0, args.duration_s, args.seed)
    dtype_bytes = 2 if ceilings.device.startswith("cuda") else 4
    rps = roofline_rps(setting, trace, ceilings, args.batch, None, dtype_bytes)  # adapters at the mean rank
    attainable = attainable_rps(setting, trace, ceilings, args.batch, None, dtype_bytes)
    at_held = held(ceilings)
    rps_held = roofline_rps(setting, trace, at_held, args.batch, None, dtype_bytes) if at_held else None
    out = {"setting": setting.name, "n_adapters": args.n, "batch": args.batch, "requests": len(trace),
           "roofline_rps": rps, "attainable_rps": attainable, "roofline_rps_held": rps_held,
           "ceilings": ceilings.as_dict()}
    if args.json:
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        c = ceilings
        host = "" if args.hbm_gbs > 0 else f", host-to-device {c.h2d_gbs:.1f} GB/s{'' if c.pinned else ' (not pinned)'}"
        sys.stdout.write(f"{c.name}: device-to-device copy {c.hbm_gbs:.1f} GB/s, {c.matmul_dtype} matmul "
                         f"{c.matmul_tflops:.2f} TFLOP/s{host}\n"
                         f"{setting.name} (n={args.n}, batch {args.batch}, {len(trace)} requests): roofline "
                         f"{rps:.2f} req/s; each operation at the ceiling that binds it (GEMMs past the ridge "
                         f"point by their FLOPs): {attainable:.2f} req/s, {attainable / rps:.2f} of the roofline\n")
        if rps_held is not None:
            sys.stdout.write(f"matmul held back to back {c.matmul_held_tflops:.2f} TFLOP/s "
                             f"({c.matmul_held_tflops / c.matmul_tflops:.3f} of the burst): roofline {rps_held:.2f} req/s\n")
    return 0


def cmd_adapters(args, argv) -> int:
    from bench.adapters import generate_adapters, register
    from bench.settings import get_setting

    setting = get_setting(args.setting)
    pop = generate_adapters(setting, args.dir, args.n, seed=args.seed, byte_budget=int(args.budget_gb * 1e9))
    sys.stdout.write(f"{args.dir}: {args.n} adapters over {pop.distinct} distinct weight sets "
                     f"({pop.distinct_bytes / 1e9:.2f} GB); written now {pop.written}, linked now {pop.linked}\n")
    if args.url:
        reg = register(args.url, args.dir, pop.names, concurrency=args.concurrency, api_key=args.api_key or None)
        sys.stdout.write(f"registered {reg.created} ({reg.rate:.1f}/s over {reg.seconds:.1f} s), {reg.already} "
                         f"already there, {len(reg.failed)} failed\n")
        for name, message in list(reg.failed.items())[:20]:
            sys.stderr.write(f"failed {name}: {message}\n")
        return 1 if reg.failed else 0
    return 0


ACTIONS = {"run": cmd_run, "sweep": cmd_sweep, "plot": cmd_plot, "targets": cmd_targets, "roofline": cmd_roofline,
           "adapters": cmd_adapters}


def _exit_on_sigterm(signum, _frame):
    raise SystemExit(128 + signum)


def _unwind_on_sigterm() -> None:
    """SIGTERM (a piece's time limit, `kill`) unwinds like Ctrl-C: the running stack is stopped on the way out."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        return ACTIONS[args.action](args, argv)
    except (ValueError, FileNotFoundError) as e:
        sys.stderr.write(f"loraplex bench {args.action}: {e}\n")
        return 2
    except RuntimeError as e:
        sys.stderr.write(f"loraplex bench {args.action}: {e}\n")
        return 1
