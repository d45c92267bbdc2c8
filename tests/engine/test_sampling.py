"""The sampler's filters against hand-computed distributions."""


import pytest
import torch

from deltaserve.engine.sampling import SamplingParams, argmax_rows, filter_logits, sample

LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))


def kept(logp):
    return (logp > float("-inf")).tolist()


def test_greedy_takes_the_first_largest_and_a_nan_as_torch_does():
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, nan, 5.0, nan], [-inf, -inf, -inf, -inf], [0.0, -1.0, inf, inf]])
    assert argmax_rows(rows) == [1, 1, 0, 2]  # by hand: first maximum; a NaN is the maximum; all equal -> 0
    assert argmax_rows(rows) == rows.argmax(-1).tolist() == argmax_rows(rows.double())  # (numpy's path and torch's)
    assert argmax_rows(rows.t().contiguous().t()) == [1, 1, 0, 2]  # a strided view
    with torch.inference_mode():
        assert argmax_rows(rows.clone()) == [1, 1, 0, 2]


def test_temperature_only_is_softmax_of_scaled_logits():
    logp = filter_logits(LOGITS, 2.0, 0, 1.0, 0.0)
    expected = torch.tensor([0.5, 0.25, 0.15, 0.1]) ** 0.5
    torch.testing.assert_close(logp.exp(), expected / expected.sum())


def test_top_k_keeps_the_k_largest():
    assert kept(filter_logits(LOGITS, 1.0, 2, 1.0, 0.0)) == [True, True, False, False]
    torch.testing.assert_close(filter_logits(LOGITS, 1.0, 2, 1.0, 0.0).exp()[:2], torch.tensor([2 / 3, 1 / 3]))


@pytest.mark.parametrize("top_p, expected", [(0.5, [True, False, False, False]), (0.6, [True, True, False, False]),
                                             (0.9, [True, True, True, False]), (1.0, [True] * 4)])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    assert kept(filter_logits(LOGITS, 1.0, 0, top_p, 0.0)) == expected


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    # p_max = 0.5: min_p 0.4 keeps p >= 0.2
    assert kept(filter_logits(LOGITS, 1.0, 0, 1.0, 0.4)) == [True, True, False, False]


def test_greedy_and_seeded_sampling():
    logits = torch.randn(3, 50)
    greedy = [SamplingParams(temperature=0)] * 3
    assert sample(logits, greedy, [None] * 3) == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits[:1], [p], [p.generator()]) for _ in range(2)]
    assert a[0] == a[1]


def test_sampling_frequencies_follow_the_distribution():
    p = SamplingParams(temperature=1.0, seed=0)
    gen = p.generator()
    draws = [sample(LOGITS[None], [p], [gen])[0] for _ in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.25, 0.15, 0.1]), atol=0.03, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(min_p=2), dict(max_tokens=-1), dict(stop=[""])],
                         ids=["temperature", "top_p0", "top_p_big", "top_k", "min_p", "max_tokens", "empty_stop"])
def test_bad_params_raise(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)




@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1e-40, 0, 1.0, 0.0), (5e-324, 0, 1.0, 0.0), (1e-6, 0, 0.5, 0.0), (1.0, 0, 5e-324, 0.0), (1.0, 0, 1e-40, 0.0),
    (2.0, 0, 1.0, 5e-324), (2.0, 0, 1.0, 1.0), (2.0, 10**30, 1.0, 0.0), (1e-300, 1, 5e-324, 1.0),
], ids=["temp_1e-40", "temp_denormal", "temp_below_greedy", "top_p_denormal", "top_p_tiny", "min_p_denormal",
        "min_p_one", "top_k_huge", "all_extreme"])
def test_extreme_values_give_a_token(temperature, top_k, top_p, min_p):
    """Any value SamplingParams accepts gives a valid token; settings that leave one candidate give the top."""
    logits = torch.randn(4, 50) * 30
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=3)
    tokens = sample(logits, [params] * 4, [params.generator() for _ in range(4)])
    assert all(0 <= t < 50 for t in tokens)
    if temperature < 1e-5 or top_p < 1e-30 or min_p == 1.0:
        assert tokens == logits.argmax(-1).tolist()
    logp = filter_logits(logits[0], temperature, top_k, top_p, min_p)
    assert not logp.isnan().any() and logp.isfinite().any() and (logp <= 0).all()  # min_p does not renormalise


def test_a_temperature_below_the_greedy_threshold_is_greedy():
    assert SamplingParams(temperature=9.9e-6).greedy and not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("kwargs", [dict(temperature=float("inf")), dict(temperature=float("nan")),
                                    dict(top_p=float("nan")), dict(min_p=float("nan")), dict(top_k=True),
                                    dict(max_tokens=2.5), dict(seed=2**64), dict(seed=-2**63 - 1),
                                    dict(seed=1.5)],
                         ids=["temp_inf", "temp_nan", "top_p_nan", "min_p_nan", "top_k_bool", "max_tokens_float",
                              "seed_big", "seed_small", "seed_float"])
def test_non_finite_or_out_of_range_values_raise(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_seeds_at_both_ends_of_the_range_seed_the_generator():
    for seed in (-2**63, 2**64 - 1):
        p = SamplingParams(seed=seed)
        assert torch.rand(3, generator=p.generator()).equal(torch.rand(3, generator=p.generator()))
