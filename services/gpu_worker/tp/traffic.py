"""Expected collective traffic of one TP forward, for comparison with what `TPComm` counts.

The S-LoRA paper's per-layer formula covers the attention block with LoRA on q, k, v, o: the base model's
all-reduce after o sends 2·(N−1)/N·B·h elements per rank; LoRA adds three all-gathers of (B, r/N) -> (B, r)
(q, k, v: (N−1)/N·B·r each) and one all-reduce of (B, r) (o: 2·(N−1)/N·B·r), about 5·(N−1)/N·B·r. Here
B is the tokens in the step and r the largest rank in the step; q/k/v (and gate/up) share one fused
all-gather, whose width is padded to N·ceil(r/N) so that every rank sends the same amount.
"""
from __future__ import annotations

from fractions import Fraction

from .layout import ceil_div


def paper_lora_elements(n: int, tokens: int, rank: int) -> Fraction:
    """Extra LoRA elements per layer for q, k, v, o: 5·(N−1)/N·B·r."""
    return Fraction(5 * (n - 1), n) * tokens * rank


def paper_base_elements(n: int, tokens: int, hidden: int) -> Fraction:
    """The base all-reduce after o, per layer: 2·(N−1)/N·B·h."""
    return Fraction(2 * (n - 1), n) * tokens * hidden


def expected_elements(n: int, tokens: int, hidden: int, num_layers: int, ranks: dict[str, int]) -> dict[str, Fraction]:
    """Elements each rank sends in one forward, by kind, when the step's largest rank per module is `ranks`
    (modules absent or 0: not adapted by any adapter in the step)."""
    def r(*modules: str) -> int:
        return max((ranks.get(m, 0) for m in modules), default=0)

    gather = Fraction(0)
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        width = n * ceil_div(r(*group), n)
        gather += len(group) * Fraction(n - 1, n) * tokens * width
    reduce = sum(Fraction(2 * (n - 1), n) * tokens * r(m) for m in ("o_proj", "down_proj"))
    base = 2 * paper_base_elements(n, tokens, hidden)  # after o and after down
    return {"base_all_reduce": base * num_layers, "lora_all_gather": gather * num_layers,
            "lora_all_reduce": reduce * num_layers}
