import pytest
import torch

from services.gpu_worker.sampling import SamplingParams, filter_logits, sample


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert sample(logits, [SamplingParams(), SamplingParams(top_k=1, temperature=1.0)], [None, None]) == [1, 0]


def test_top_k_keeps_only_the_k_largest():
    out = filter_logits(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_k=2))
    assert torch.isinf(out[[0, 3]]).all() and torch.isfinite(out[[1, 2]]).all()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.isfinite(out[[0, 1]]).all() and torch.isinf(out[[2, 3]]).all()


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.zeros(1, 1000)

    def draw(seed):
        p = SamplingParams(temperature=1.0, seed=seed)
        gen = p.make_generator()
        return [sample(logits, [p], [gen])[0] for _ in range(20)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0, seed=0)
    gen = p.make_generator()
    counts = torch.bincount(torch.tensor([sample(logits, [p], [gen])[0] for _ in range(3000)]), minlength=3)
    assert abs(counts[0].item() / 3000 - 0.7) < 0.04


@pytest.mark.parametrize("field,value,message", [
    ("max_tokens", 0, "max_tokens"), ("temperature", -1.0, "temperature"), ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"), ("top_k", -2, "top_k"), ("temperature", float("nan"), "temperature")])
def test_bad_sampling_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).validate()
