"""Which requests of a launched step can run their next decode step before its tokens reach the host.

The engine launches step N+1 while step N is still on the GPU, feeding N's sampled tokens to N+1 on the
device, so the host's bookkeeping of step N (and the worker's socket work) hides behind N+1's kernels
instead of leaving the GPU idle. That is only right when nothing the host would decide differently after
seeing N's tokens changes N+1:
- every request of N samples greedily (its token is the device argmax) and wants no logits back (the
  logits buffer of a replayed graph is overwritten by N+1);
- N ran every running request (nobody left out by the token budget), so N+1 holds N's requests: their
  decode rows, and, where N ran only part of a prompt (chunked prefill), that prompt's next chunk, whose
  tokens the host has (with overlap_admission, since it makes the step an eager prefill step);
- an admission round that is due (EngineConfig.overlap_admission) joins the step beside the decode rows, its
  prompts' tokens known to the host. It may take the places of requests ending by length at N: nothing
  after N reads their slots, and N+1 runs behind N on the stream. A round that needs the places of requests
  whose abort arrived during N is scheduled on the host once N's tokens are in (their slots are freed then);
  one that needs the places of requests ending by a stop token at N becomes due only once N's tokens show
  them, and goes ahead of the step after;
- a request that ends by length at N, or whose abort arrived during N, is left out. One that ends by a
  stop token at N is not known yet: it runs one wasted step in N+1, whose token is dropped.
"""
from __future__ import annotations

from .requests import Sequence, StepInFlight

# Stands for a token sampled on the device and not yet seen by the host; replaced when it arrives.
PENDING_TOKEN = -1


def ends_by_length(seq: Sequence, max_model_len: int) -> bool:
    """Whether the token step N samples for `seq` (not yet appended) is its last by length."""
    return seq.num_output + 1 >= seq.req.sampling.max_tokens or len(seq.tokens) + 1 >= max_model_len


def lookahead_rows(flight: StepInFlight, num_running: int, deferred_aborts: set[str], max_model_len: int,
                   max_tokens: int, unfinished: int = 0) -> list[int] | None:
    """Rows of `flight.samplers` that continue into the next step, or None when it must be scheduled on
    the host after `flight`'s tokens arrive. `unfinished`: requests of `flight` whose prompt goes on (they
    sampled nothing; unfinished_prompts)."""
    samplers = flight.samplers
    if not samplers or flight.greedy is None or len(flight.scheduled) != len(samplers) + unfinished:
        return None
    if num_running != len(samplers) - len(flight.dropped) + unfinished:
        return None  # someone running was not in this step (token budget): let the scheduler see them
    if any(not s.req.sampling.greedy or s.req.return_logits for s in samplers):
        return None
    rows = [i for i, s in enumerate(samplers) if s not in flight.dropped and s.request_id not in deferred_aborts
            and not ends_by_length(s, max_model_len)]
    if not rows or len(rows) > max_tokens:
        return None
    return rows


def ending_by_length(flight: StepInFlight, rows: list[int], deferred_aborts: set[str],
                     max_model_len: int) -> list[Sequence]:
    """Requests of `flight` not continuing into the next step because the token it samples is their last by
    length (known on the host before the token is); aborted and already dropped ones are not among them."""
    keep = set(rows)
    return [s for i, s in enumerate(flight.samplers) if i not in keep and s not in flight.dropped
            and s.request_id not in deferred_aborts and ends_by_length(s, max_model_len)]


def unfinished_prompts(flight: StepInFlight, running: list[Sequence]) -> list[Sequence]:
    """Requests of `flight` whose prompt it ran only part of (they sample nothing), in the running order the
    host's scheduler gives them their next chunk in."""
    if len(flight.scheduled) == len(flight.samplers):
        return []  # every request of the step sampled (the usual decode step): nothing to look for
    sampled = set(flight.samplers)
    return [s for s in running if s in flight.scheduled and s not in sampled]
