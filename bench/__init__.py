"""The benchmark suite: S-LoRA's evaluation (workloads, load client, metrics, rooflines, baselines, plots)."""
