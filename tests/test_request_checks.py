"""The checks the gateway and the router's own API both apply to a generation request
(services/common/request_checks.py): each bad field refused with a message saying what to fix."""
import pytest

from specmesh_services.common.request_checks import (MAX_STOP_LENGTH, MAX_STOP_SEQUENCES,
                                                      check_request)
from specmesh_services.common.sampling import SamplingParams

GOOD = dict(prompt_ids=[1, 2, 3], max_tokens=4, sampling=SamplingParams(), stop=["\n"],
            context_length=8, vocab_size=10)


def test_a_good_request_passes_with_and_without_a_vocabulary():
    check_request(**GOOD)
    check_request(**{**GOOD, "vocab_size": None, "prompt_ids": [10**6]})


@pytest.mark.parametrize("change,message", [
    ({"prompt_ids": []}, "prompt is empty"),
    ({"prompt_ids": [1, 10]}, r"prompt_ids must be in \[0, 10\)"),
    ({"prompt_ids": [-1]}, r"prompt_ids must be in \[0, 10\)"),
    ({"prompt_ids": [1] * 8}, "prompt is too long: 8 tokens, but the model's context is 8"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"sampling": SamplingParams(temperature=-1.0)}, "temperature must be >= 0"),
    ({"stop": [""]}, "stop sequences must be non-empty"),
    ({"stop": ["x" * (MAX_STOP_LENGTH + 1)]}, "stop sequences must be at most"),
    ({"stop": ["x"] * (MAX_STOP_SEQUENCES + 1)}, "stop sequences are allowed"),
])
def test_each_bad_field_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        check_request(**{**GOOD, **change})
