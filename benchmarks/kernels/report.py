"""Markdown tables and PNG plots from gpu_proof's results (also usable on a saved kernels.json:
`python -m benchmarks.kernels.report kernels.json OUT_DIR`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _f(v, fmt="{:.1f}"):
    if v is None:
        return "-"
    if isinstance(v, float) and v != v:
        return "nan"
    return fmt.format(v) if isinstance(v, (int, float)) else str(v)


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def variant_times(row: dict) -> dict[str, float]:
    """A timed row's variants and their microseconds: its `ours_<variant>_us` keys beside the chosen launch's
    `ours_us`."""
    return {k[5:-3]: v for k, v in row.items() if k.startswith("ours_") and k.endswith("_us") and k != "ours_us"}


def _variants(row: dict, fmt: str) -> str:
    return ", ".join(f"{name} {fmt.format(us)}" for name, us in variant_times(row).items()) or "-"


def write_tables(res: dict) -> str:
    env = res.get("env", {})
    hbm = res.get("ceilings", {}).get("copy_gbs")
    parts = [f"Environment: {json.dumps(env)}\n"]
    if "ceilings" in res:
        c = res["ceilings"]
        parts.append(f"Ceilings: device copy {c['copy_gbs']:.0f} GB/s (read + write), "
                     f"bf16 matmul 8192³ {c['matmul_tflops']:.0f} TFLOP/s\n")
    if "correctness" in res:
        parts.append(_table(["check", "model", "tokens", "rel. error", "ok"],
                            [[r["check"], r["model"], r["tokens"], _f(r["rel_err"], "{:.2e}"), r.get("ok")]
                             for r in res["correctness"]]))
    if "lora" in res:
        rows = []
        for r in res["lora"]:
            pct = 100 * r["ours_gbs"] / hbm if hbm else None
            rows.append([r["model"], r["group"], r["batch"], r["distinct_adapters"], _f(r["adapter_bytes"] / 1e6),
                         _f(r["ours_token_us"]), _f(r["ours_grouped_us"]), _f(r["grouping_us"]), _f(r["bmm_us"]),
                         _f(r["gather_bmm_us"]), _f(r["ours_gbs"], "{:.0f}"), _f(pct, "{:.0f}%"),
                         _f(r["speedup_vs_bmm"], "{:.2f}x"), _f(r["speedup_vs_gather_bmm"], "{:.2f}x")])
        parts.append(_table(["model", "group", "batch", "adapters", "adapter MB", "ours per-token µs",
                             "ours grouped µs", "grouping µs (once/step)", "padded bmm µs", "gather+bmm µs",
                             "ours GB/s", "% HBM", "vs bmm", "vs gather+bmm"], rows))
        rows = [[r["group"], r["batch"], _f(r["ours_token_shrink_us"]), _f(r["ours_token_expand_us"]),
                 _f(r["ours_grouped_shrink_us"]), _f(r["ours_grouped_expand_us"])] for r in res["lora"]]
        parts.append(_table(["group", "batch", "per-token shrink µs", "per-token expand µs", "grouped shrink µs",
                             "grouped expand µs"], rows))
    if "lora_sweep" in res:
        parts.append(_table(["model", "batch", "form", "op", "variant", "µs", "GB/s", "config"],
                            [[r["model"], r["batch"], r["form"], r["op"], r["variant"], _f(r["us"]),
                              _f(r["gbs"], "{:.0f}"), r["config"]] for r in res["lora_sweep"]]))
    if "attention_served" in res:
        rows = []
        for r in res["attention_served"]:
            pct = 100 * r["ours_gbs"] / hbm if hbm else None
            rows.append([r["model"], r["batch"], _f(r["context_mean"], "{:.0f}"), r["context_max"], r["slot_run"],
                         r["pool_slots"], _f(r["kv_bytes"] / 1e6, "{:.0f}"), _f(r["ours_us"]),
                         _f(r["ours_gbs"], "{:.0f}"), _f(pct, "{:.0f}%"), _variants(r, "{:.1f}")])
        parts.append(_table(["model", "batch", "mean context", "longest", "slot run", "pool slots", "KV MB", "ours µs",
                             "ours GB/s", "% HBM", "variants (µs)"], rows))
    if "attention_mixed" in res:
        parts.append(_table(["model", "decode rows", "mean context", "prompts", "prompt tokens", "decode K/V MB",
                             "one launch µs", "decode rows apart µs", "apart GB/s (decode K/V)"],
                            [[r["model"], r["running"], _f(r["context_mean"], "{:.0f}"), r["prompts"],
                              r["prompt_tokens"], _f(r["decode_kv_bytes"] / 1e6, "{:.0f}"), _f(r["one_launch_us"]),
                              _f(r["decode_apart_us"]), _f(r["decode_apart_gbs"], "{:.0f}")]
                             for r in res["attention_mixed"]]))
    if "attention" in res:
        rows = []
        for r in res["attention"]:
            pct = 100 * r["ours_gbs"] / hbm if hbm else None
            rows.append([r["model"], r["batch"], r["context"], _f(r["kv_bytes"] / 1e6, "{:.0f}"), _f(r["ours_us"]),
                         _f(r["ours_gbs"], "{:.0f}"), _f(pct, "{:.0f}%"), _f(r.get("sdpa_us")),
                         _f(r.get("sdpa_gbs"), "{:.0f}"), _f(r.get("rel_err_vs_sdpa_fp32"), "{:.1e}"),
                         _variants(r, "{:.0f}")])
        parts.append(_table(["model", "batch", "context", "KV MB", "ours µs", "ours GB/s", "% HBM", "SDPA µs",
                             "SDPA GB/s", "rel. err vs fp32", "variants (µs)"], rows))
    if "prefill" in res:
        parts.append(_table(["model", "seqs", "length", "ours µs", "ours TFLOP/s", "SDPA µs", "SDPA TFLOP/s"],
                            [[r["model"], r["seqs"], r["length"], _f(r["ours_us"]), _f(r["ours_tflops"]),
                              _f(r["sdpa_us"]), _f(r["sdpa_tflops"])] for r in res["prefill"]]))
    for name, err in res.get("errors", {}).items():
        parts.append(f"Section {name} failed:\n```\n{err}\n```\n")
    return "\n".join(parts)


def write_plots(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hbm = res.get("ceilings", {}).get("copy_gbs")
    if "lora" in res:
        groups = sorted({r["group"] for r in res["lora"]})
        fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.2), squeeze=False)
        for ax, group in zip(axes[0], groups):
            rs = [r for r in res["lora"] if r["group"] == group]
            b = [r["batch"] for r in rs]
            for key, label in [("ours_token_us", "ours, per-token"), ("ours_grouped_us", "ours, grouped"),
                               ("bmm_us", "padded bmm"), ("gather_bmm_us", "gather + bmm")]:
                ax.plot(b, [r["adapter_bytes"] / r[key] / 1e3 for r in rs], marker="o", label=label)
            if hbm:
                ax.axhline(hbm, color="gray", ls="--", label="device copy")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch (decode tokens)")
            ax.set_ylabel("GB/s of adapter bytes needed")
            ax.set_title(f"LoRA shrink+expand, {rs[0]['model']} {group}, ranks 8-64 mixed")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "lora_bandwidth.png", dpi=110)
    if "attention" in res:
        models = sorted({r["model"] for r in res["attention"]})
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
        for ax, model in zip(axes[0], models):
            rs = [r for r in res["attention"] if r["model"] == model]
            c = [r["context"] for r in rs]
            ax.plot(c, [r["ours_gbs"] for r in rs], marker="o", label="ours, paged")
            ax.plot(c, [r.get("sdpa_gbs", float("nan")) for r in rs], marker="o", label="SDPA, contiguous")
            if hbm:
                ax.axhline(hbm, color="gray", ls="--", label="device copy")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context")
            ax.set_ylabel("GB/s of KV read")
            ax.set_title(f"decode attention, {model}")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "attention_bandwidth.png", dpi=110)


if __name__ == "__main__":
    data = json.loads(Path(sys.argv[1]).read_text())
    dest = Path(sys.argv[2])
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "kernels.md").write_text(write_tables(data))
    write_plots(data, dest)
