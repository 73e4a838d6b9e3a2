"""Logit processing against a loop-based reference (temperature / top-k / top-p; repetition,
presence and frequency penalties); validation; seeded determinism; the protobuf round trip."""
import pytest
import torch

from specmesh_services.common.sampling import Sampler, SamplingParams, apply_penalties, probabilities


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
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (SamplingParams(repetition_penalty=-1.2), "repetition_penalty must be a finite number > 0"),
    (SamplingParams(repetition_penalty=float("nan")), "repetition_penalty"),
    (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty"),
    (SamplingParams(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (SamplingParams(presence_penalty=float("nan")), "presence_penalty"),
    (SamplingParams(frequency_penalty=-2.01), r"frequency_penalty must be in \[-2, 2\]"),
    (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
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


def test_protobuf_round_trip_keeps_penalties_and_leaves_off_ones_unset():
    params = SamplingParams(repetition_penalty=1.25, presence_penalty=-0.5, frequency_penalty=0.75)
    back = SamplingParams.from_pb(params.to_pb())
    assert (back.repetition_penalty, back.presence_penalty, back.frequency_penalty) == \
        (1.25, -0.5, 0.75)  # exact in float32
    assert back.penalized
    pb = SamplingParams().to_pb()
    assert not any(pb.HasField(f) for f in ("repetition_penalty", "presence_penalty",
                                             "frequency_penalty"))
    default = SamplingParams.from_pb(pb)
    assert (default.repetition_penalty, default.presence_penalty, default.frequency_penalty) == \
        (1.0, 0.0, 0.0) and not default.penalized


# ---------------------------------------------------------------------------------------------
# penalties


def reference_penalties(logits, history, prompt_len, repetition=1.0, presence=0.0, frequency=0.0):
    """Loop-based reference: HF repetition penalty over every distinct token of the history,
    then OpenAI presence / frequency over the generated part, one token at a time."""
    out = [float(x) for x in logits]
    for t in set(history):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    generated = list(history[prompt_len:])
    for t in set(generated):
        out[t] -= presence + frequency * generated.count(t)
    return out


LOGITS = [2.0, -1.5, 0.0, 3.5, -0.25, 1.0, -4.0, 0.5]
#             prompt          | generated
HISTORY = [1, 3, 3, 6, 0, 1, 6, 6, 5, 3]  # 1: prompt + generated; 6: prompt, then twice more
PROMPT_LEN = 4


@pytest.mark.parametrize("repetition,presence,frequency", [
    (1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.8, 0.0), (1.0, 0.0, 0.6), (1.0, -1.0, -0.4),
    (1.5, 0.5, 0.25), (2.0, 2.0, 2.0)])
def test_penalties_match_loop_reference(repetition, presence, frequency):
    params = SamplingParams(repetition_penalty=repetition, presence_penalty=presence,
                            frequency_penalty=frequency)
    logits = torch.tensor(LOGITS)
    got = apply_penalties(logits, torch.tensor(HISTORY), PROMPT_LEN, params)
    want = reference_penalties(LOGITS, HISTORY, PROMPT_LEN, repetition, presence, frequency)
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert logits.tolist() == LOGITS  # the input row is left alone


def test_penalties_on_random_logits_and_long_histories():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(50, generator=gen) * 4
        history = torch.randint(0, 50, (int(torch.randint(0, 300, (1,), generator=gen)),),
                                generator=gen)
        prompt_len = int(torch.randint(0, len(history) + 1, (1,), generator=gen))
        params = SamplingParams(repetition_penalty=1.0 + trial / 10, presence_penalty=0.3,
                                frequency_penalty=0.1 * (trial % 3))
        got = apply_penalties(logits, history, prompt_len, params)
        want = reference_penalties(logits.tolist(), history.tolist(), prompt_len, 1.0 + trial / 10,
                                   0.3, 0.1 * (trial % 3))
        assert got.tolist() == pytest.approx(want, abs=1e-5)


def test_repetition_penalty_is_applied_once_per_distinct_token_with_the_sign_rule():
    logits = torch.tensor([2.0, -2.0, 0.0, 1.0])
    got = apply_penalties(logits, [0, 0, 0, 1, 1, 2], 6, SamplingParams(repetition_penalty=2.0))
    assert got.tolist() == [1.0, -4.0, 0.0, 1.0]  # positive halved, negative doubled, once each


def test_presence_and_frequency_count_only_generated_tokens():
    logits = torch.zeros(4)
    history = [0, 0, 1, 2, 2, 2]  # prompt: 0 0 1 | generated: 2 2 2
    presence = apply_penalties(logits, history, 3, SamplingParams(presence_penalty=0.5))
    assert presence.tolist() == [0.0, 0.0, -0.5, 0.0]  # once, whatever the count
    frequency = apply_penalties(logits, history, 3, SamplingParams(frequency_penalty=0.5))
    assert frequency.tolist() == [0.0, 0.0, -1.5, 0.0]  # per occurrence
    nothing_generated = apply_penalties(logits, history, 6, SamplingParams(presence_penalty=1.0,
                                                                           frequency_penalty=1.0))
    assert nothing_generated.tolist() == [0.0] * 4
    repetition = apply_penalties(torch.ones(4), history, 3, SamplingParams(repetition_penalty=2.0))
    assert repetition.tolist() == [0.5, 0.5, 0.5, 1.0]  # repetition counts the prompt too


def test_greedy_takes_the_argmax_of_the_penalized_logits():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    plain = Sampler(SamplingParams(), seed=0)
    assert plain.sample(logits, 2, [1, 1]) == 1
    penalized = Sampler(SamplingParams(repetition_penalty=1.2), seed=0, prompt_len=1)
    assert penalized.sample(logits, 2, [3, 1]) == 2  # 2.0 / 1.2 < 1.9
    assert penalized.sample(logits, 2, [3, 0]) == 1  # 1 not in the history
    freq = Sampler(SamplingParams(frequency_penalty=0.2), seed=0, prompt_len=2)
    assert freq.sample(logits, 3, [1, 1, 3]) == 1  # 1 only in the prompt: no frequency penalty
    assert freq.sample(logits, 3, [3, 3, 1]) == 2
    assert Sampler(SamplingParams(top_k=1, presence_penalty=0.5), 0, 0).sample(
        logits, 1, [1]) == 2  # top_k=1 is greedy too


def test_penalized_sampling_draws_from_the_penalized_distribution():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    params = SamplingParams(temperature=1.0, repetition_penalty=3.0, frequency_penalty=1.0)
    sampler = Sampler(params, seed=3, prompt_len=0)
    history = [0, 0, 1]
    assert sampler.sample(logits, 3, history) == Sampler(params, seed=3).sample(
        logits, 3, history)  # seeded
    expected = probabilities(apply_penalties(logits, history, 0, params), params)
    counts = torch.zeros(4)
    for seed in range(2000):
        counts[Sampler(params, seed).sample(logits, 3, history)] += 1
    assert (counts / 2000).tolist() == pytest.approx(expected.tolist(), abs=0.04)
    assert expected[0] < expected[1] < expected[2] == expected[3]


def test_penalized_sampler_needs_the_history_before_the_position():
    sampler = Sampler(SamplingParams(presence_penalty=0.5), seed=0, prompt_len=1)
    assert sampler.needs_history and not Sampler(SamplingParams(), 0).needs_history
    with pytest.raises(ValueError, match="tokens before position"):
        sampler.sample(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="tokens before position"):
        sampler.sample(torch.zeros(4), 3, [1, 2])


@pytest.mark.parametrize("params", [
    SamplingParams(), SamplingParams(top_k=1), SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(repetition_penalty=1.3), SamplingParams(temperature=1.0, top_k=5,
                                                           presence_penalty=0.5)])
def test_a_numpy_row_draws_what_its_tensor_draws(params):
    """llama.cpp's logits arrive as numpy rows: greedy without penalties takes their argmax
    directly (ties: the first index, as torch's), anything else goes through the tensor path."""
    generator = torch.Generator().manual_seed(5)
    rows = torch.randn(40, 64, generator=generator)
    rows[0, [3, 9]] = rows[0].max() + 1  # a tie: the first index wins
    history = torch.randint(0, 64, (12,), generator=generator).tolist()
    sampler = Sampler(params, seed=11, prompt_len=4)
    for i, row in enumerate(rows):
        past = history if params.penalized else None  # penalties: the tokens before position 12
        position = len(history) if past else i
        assert sampler.sample(row.numpy(), position, past) == sampler.sample(row, position, past)
    assert Sampler(SamplingParams(), 0).sample(rows[0].numpy(), 0) == 3
