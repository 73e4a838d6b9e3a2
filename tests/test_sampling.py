"""Logit processing against a loop-based reference; validation; seeded determinism."""
import pytest
import torch

from services.common.sampling import Sampler, SamplingParams, probabilities


def reference_probabilities(logits, temperature, top_k, top_p):
    """Loop-based reference: temperature, then top-k, then top-p, one token at a time."""
    scaled = [x / temperature for x in logits.tolist()]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[:top_k] if top_k else order)
    exp = {i: torch.tensor(scaled[i]).exp().item() for i in keep}
    total = sum(exp.values())
    probs = {i: exp[i] / total for i in keep}
    if top_p < 1:
        kept, mass = set(), 0.0
        for i in sorted(probs, key=lambda i: -probs[i]):
            if mass >= top_p:
                break
            kept.add(i)
            mass += probs[i]
        total = sum(probs[i] for i in kept)
        probs = {i: probs[i] / total for i in kept}
    return [probs.get(i, 0.0) for i in range(len(scaled))]


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.5, 7, 0.6), (2.0, 3, 0.3)])
def test_probabilities_match_loop_reference(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(23) * 3
    got = probabilities(logits, SamplingParams(temperature, top_p, top_k))
    want = reference_probabilities(logits, temperature, top_k, top_p)
    assert got.tolist() == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("params,message", [
    (SamplingParams(temperature=-0.1), "temperature"),
    (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_k=-1), "top_k"),
])
def test_invalid_parameters_say_what_to_fix(params, message):
    with pytest.raises(ValueError, match=message):
        params.validate()


def test_greedy_is_argmax_and_seeded_draws_are_reproducible():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert Sampler(SamplingParams(), seed=1).sample(logits, 0) == 1
    hot = Sampler(SamplingParams(temperature=1.0), seed=7)
    draws = [hot.sample(logits, p) for p in range(50)]
    assert draws == [Sampler(SamplingParams(temperature=1.0), seed=7).sample(logits, p)
                     for p in range(50)]
    assert len(set(draws)) > 1  # positions draw independently
    other = [Sampler(SamplingParams(temperature=1.0), seed=8).sample(logits, p) for p in range(50)]
    assert other != draws


def test_protobuf_round_trip_keeps_unset_seed_and_top_p():
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=3, seed=11)
    back = SamplingParams.from_pb(params.to_pb())
    assert (back.top_k, back.seed) == (3, 11) and back.top_p == pytest.approx(0.9)
    default = SamplingParams.from_pb(SamplingParams().to_pb())
    assert default.seed is None and default.top_p == 1.0
