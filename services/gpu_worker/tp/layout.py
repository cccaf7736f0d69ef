"""How a Llama-family model is cut over N tensor-parallel ranks (Megatron-LM style).

q, k, v, gate and up are column-parallel (each rank owns a slice of their output features: whole attention
heads, whole KV heads, a slice of the intermediate features); o and down are row-parallel (each rank owns the
matching slice of their input features and produces a partial sum of the full hidden output, summed by one
all-reduce). Each rank's pool shard holds its own KV heads, so its slot width is (num_kv_heads / N) * head_dim.

LoRA follows S-LoRA: on column-parallel modules A is split along the rank dimension and Bᵀ along the output;
on row-parallel modules A is split along the input and Bᵀ along the hidden output, each rank owning one
contiguous slice of the hidden features (`hidden_cols`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shared.model_config import MODULES, ModelConfig

COLUMN_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_MODULES = ("o_proj", "down_proj")
COLUMN_INDEX = tuple(MODULES.index(m) for m in COLUMN_MODULES)


class TPLayoutError(ValueError):
    """The model cannot be split over the requested number of ranks."""


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TPLayout:
    cfg: ModelConfig
    size: int

    def __post_init__(self) -> None:
        n, cfg = self.size, self.cfg
        if n < 1:
            raise TPLayoutError(f"tensor-parallel size must be >= 1, got {n}")
        if cfg.num_kv_heads % n:
            # KV heads are never replicated: each rank's pool shard holds whole KV heads of its own.
            kind = "GQA " if cfg.num_kv_heads != cfg.num_heads else ""
            raise TPLayoutError(
                f"cannot split {cfg.num_kv_heads} KV heads over {n} ranks: tensor parallelism needs "
                f"num_key_value_heads % tp == 0 ({kind}model with {cfg.num_heads} query heads, "
                f"{cfg.num_kv_heads} KV heads); use tp in {divisors(cfg.num_kv_heads)}")
        if cfg.num_heads % n:
            raise TPLayoutError(f"cannot split {cfg.num_heads} attention heads over {n} ranks "
                                f"(num_attention_heads % tp must be 0)")
        if cfg.intermediate_size % n:
            raise TPLayoutError(f"cannot split intermediate_size {cfg.intermediate_size} over {n} ranks "
                                f"(intermediate_size % tp must be 0)")
        if cfg.hidden_size % n:
            raise TPLayoutError(f"cannot split hidden_size {cfg.hidden_size} over {n} ranks "
                                f"(hidden_size % tp must be 0: row-parallel LoRA outputs are hidden slices)")

    # ---- per-rank widths ------------------------------------------------------------------------
    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return self.cfg.num_kv_heads // self.size

    @property
    def q_dim(self) -> int:
        return self.heads * self.cfg.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.cfg.head_dim

    @property
    def slot_width(self) -> int:
        """Width of a pool shard's rows: this rank's KV heads of one token."""
        return self.kv_dim

    @property
    def intermediate(self) -> int:
        return self.cfg.intermediate_size // self.size

    @property
    def hidden(self) -> int:
        return self.cfg.hidden_size // self.size

    # ---- per-rank slices of the full features -----------------------------------------------------
    def q_cols(self, rank: int) -> slice:
        return slice(rank * self.q_dim, (rank + 1) * self.q_dim)

    def kv_cols(self, rank: int) -> slice:
        return slice(rank * self.kv_dim, (rank + 1) * self.kv_dim)

    def inter_cols(self, rank: int) -> slice:
        return slice(rank * self.intermediate, (rank + 1) * self.intermediate)

    def hidden_cols(self, rank: int) -> slice:
        return slice(rank * self.hidden, (rank + 1) * self.hidden)

    def output_cols(self, module: str, rank: int) -> slice:
        """The output features of a column-parallel module that `rank` computes."""
        if module == "q_proj":
            return self.q_cols(rank)
        if module in ("k_proj", "v_proj"):
            return self.kv_cols(rank)
        if module in ("gate_proj", "up_proj"):
            return self.inter_cols(rank)
        raise KeyError(f"{module} is not column-parallel")

    def input_cols(self, module: str, rank: int) -> slice:
        """The input features of a row-parallel module that `rank` holds."""
        if module == "o_proj":
            return self.q_cols(rank)
        if module == "down_proj":
            return self.inter_cols(rank)
        raise KeyError(f"{module} is not row-parallel")

    # ---- LoRA shard geometry ----------------------------------------------------------------------
    def shrink_rank(self, module: str, rank: int) -> int:
        """Rows of A one rank holds for an adapter of rank `rank` on `module`. Column-parallel: rows are dealt
        round-robin (row k on rank k % N), so a rank not divisible by N costs each rank at most one row of
        padding; row-parallel: every rank holds all r rows, over its slice of the input."""
        return ceil_div(rank, self.size) if module in COLUMN_MODULES else rank

    def shard_row_lengths(self, module: str) -> tuple[int, int]:
        """(length of one A row, length of one Bᵀ row) on a rank."""
        h = self.cfg.hidden_size
        if module == "q_proj":
            return h, self.q_dim
        if module in ("k_proj", "v_proj"):
            return h, self.kv_dim
        if module in ("gate_proj", "up_proj"):
            return h, self.intermediate
        if module == "o_proj":
            return self.q_dim, self.hidden
        if module == "down_proj":
            return self.intermediate, self.hidden
        raise KeyError(f"unknown module {module!r}")

    def local_config(self) -> ModelConfig:
        """One rank's shard seen as a narrower model (its heads, KV heads and intermediate features; the hidden
        size stays whole). Sizing the pool, the adapter tables and the RoPE tables from it needs no TP logic."""
        return dataclasses.replace(self.cfg, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                   intermediate_size=self.intermediate)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
