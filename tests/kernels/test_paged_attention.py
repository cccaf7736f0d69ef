"""Triton paged attention against ops.reference.attention: decode (GQA, split context) and prefill/extend."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_matches

from services.gpu_worker.kernels import attention
from services.gpu_worker.kernels.paged_attention import AttentionConfig
from services.gpu_worker.ops import reference
from services.gpu_worker.ops.meta import AttnMeta
from services.gpu_worker.pool import UnifiedPool

# (query heads, KV heads, head_dim): GQA group 2 with a head_dim that is not a power of two, and group 4.
HEADS = {"gqa2-hd10": (4, 2, 10), "gqa4-hd16": (8, 2, 16)}


def paged_batch(q_lens, ctx_lens, heads, dtype, seed):
    """A pool holding each sequence's context at scattered slots, and the step's queries."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    width = num_kv_heads * head_dim
    pool = UnifiedPool(1, sum(ctx_lens) + 40, width, dtype, "cpu")
    ids = pool.allocator.allocate(pool.num_slots)
    random.Random(seed).shuffle(ids)
    pool.allocator.free(ids)
    pool.kv.normal_(generator=gen)
    max_ctx = max(ctx_lens)
    table = torch.zeros(len(ctx_lens), max_ctx + 3, dtype=torch.int32)
    for b, ctx in enumerate(ctx_lens):
        table[b, :ctx] = torch.tensor(pool.allocator.allocate(ctx), dtype=torch.int32)
    q_start = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    meta = AttnMeta(q_start=q_start, ctx_lens=torch.tensor(ctx_lens, dtype=torch.int32), slot_table=table,
                    max_q_len=max(q_lens), max_ctx_len=max_ctx, decode_only=all(n == 1 for n in q_lens))
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, pool, meta


def check(q_lens, ctx_lens, heads, dtype, seed, config=None):
    q, pool, meta = paged_batch(q_lens, ctx_lens, heads, dtype, seed)
    scale = heads[2] ** -0.5
    ref = reference.attention(q, pool.k(0), pool.v(0), meta, scale)
    out = torch.full_like(q, float("nan"))
    got = attention(q, pool.k(0), pool.v(0), meta, scale, out=out, config=config)
    assert got is out
    assert_matches(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("n_split", [1, 3])
def test_decode_matches_reference(dtype, heads, n_split):
    # Contexts of 1 token, odd lengths, and more than two 64-token blocks; splits that end up empty.
    config = AttentionConfig(block_q=16, block_n=64, n_split=n_split)
    check([1, 1, 1, 1], [1, 37, 70, 130], HEADS[heads], dtype, seed=n_split, config=config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("n_split", [1, 2])
def test_prefill_and_extend_match_reference(dtype, heads, n_split):
    # A whole prompt, a decode token in a mixed step, an extend of 9 tokens over a 31-token prefix, a
    # sequence with no new tokens, and a prompt longer than one query block.
    config = AttentionConfig(block_q=8, block_n=16, n_split=n_split)
    check([5, 1, 9, 0, 19], [5, 20, 40, 7, 19], HEADS[heads], dtype, seed=10 + n_split, config=config)


@pytest.mark.parametrize("q_lens, ctx_lens, n_split", [([1, 1, 1, 1], [1, 37, 70, 130], 3),
                                                     ([5, 1, 9, 0, 19], [5, 20, 40, 7, 19], 2)],
                         ids=["decode-split", "mixed"])
def test_heads_first_launch_order_computes_the_same_bits(q_lens, ctx_lens, n_split):
    # Only the order programs start in changes (two KV heads, so it does change): each program sums the same
    # keys in the same order, so the outputs agree bit for bit, and with the reference.
    q, pool, meta = paged_batch(q_lens, ctx_lens, HEADS["gqa4-hd16"], torch.float32, seed=31)
    scale = 16 ** -0.5
    outs = [attention(q, pool.k(0), pool.v(0), meta, scale,
                      config=AttentionConfig(block_q=8, block_n=16, n_split=n_split, heads_first=first))
            for first in (False, True)]
    assert torch.equal(outs[0], outs[1])
    assert_matches(outs[1], reference.attention(q, pool.k(0), pool.v(0), meta, scale), torch.float32)


@pytest.mark.parametrize("q_lens, ctx_lens", [([1, 1, 1, 5, 9], [37, 130, 3, 5, 300]),
                                              ([1, 1, 19, 1, 0], [70, 1, 19, 50, 7])],
                         ids=["short-extends", "prompt-then-decode"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_a_mixed_steps_decode_rows_launched_apart_match_the_reference(q_lens, ctx_lens, heads):
    # The leading decode rows in their own launch (contexts split: 4 multiprocessors on the CPU), the rest in
    # another, which splits its contexts too when its new tokens are few (short extends): each launch's
    # partials are its own tokens'. A decode row after the prompt stays with the rest.
    q, pool, meta = paged_batch(q_lens, ctx_lens, HEADS[heads], torch.float32, seed=41)
    lead = next(i for i, n in enumerate(q_lens) if n != 1)
    meta.decode_seqs, meta.decode_max_ctx = lead, max(ctx_lens[:lead])
    scale = HEADS[heads][2] ** -0.5
    apart = attention(q, pool.k(0), pool.v(0), meta, scale, out=torch.full_like(q, float("nan")), split_decode=True)
    assert_matches(apart, reference.attention(q, pool.k(0), pool.v(0), meta, scale), torch.float32)
    assert_matches(apart, attention(q, pool.k(0), pool.v(0), meta, scale, split_decode=False), torch.float32)


def test_default_launch_shapes_decode_and_prefill():
    check([1, 1, 1], [3, 90, 300], HEADS["gqa4-hd16"], torch.float32, seed=21)
    check([7, 12], [7, 30], HEADS["gqa2-hd10"], torch.float32, seed=22)


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(q=a["q"][:, :3]), "3 query heads do not split evenly over 2 KV heads"),
    (lambda a: a.update(q=a["q"][..., :3]), "pool width 20 is not a multiple of head_dim 3"),
    (lambda a: a["meta"].__setattr__("ctx_lens", a["meta"].ctx_lens.long()), "meta.ctx_lens must have dtype torch.int32"),
    (lambda a: a.update(out=torch.empty(1, 4, 10)), "out must have q's shape"),
])
def test_attention_rejects_bad_arguments(mutate, message):
    q, pool, meta = paged_batch([1, 1], [4, 9], HEADS["gqa2-hd10"], torch.float32, seed=1)
    args = dict(q=q, meta=meta, out=None)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        attention(args["q"], pool.k(0), pool.v(0), args["meta"], 0.3, out=args["out"])
