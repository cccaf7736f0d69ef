"""Baseline servers the benchmarks compare loraplex with (same trace, same GPU, same HTTP subset)."""
