"""Core placement: the split gives the verifier and the drafting roles disjoint cores, a pinned
compute thread runs (and creates its OpenMP team) on its cores with its thread count, and the
thread gets its cores back."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specmesh_services.common import cores


def test_shared_gives_every_role_every_core():
    plan = cores.plan("shared", available={0, 1, 2, 3})
    assert not plan.split and plan.cpus("verifier") == plan.cpus("drafter") == {0, 1, 2, 3}
    assert (plan.threads("verifier"), plan.threads("drafter"), plan.threads("router")) == (4, 2, 1)


@pytest.mark.parametrize("available,drafter_cores,verifier,drafting", [
    ({0, 1}, 0, {0}, {1}),
    ({0, 1, 2, 3, 4, 5, 6, 7, 8}, 0, {0, 1, 2, 3, 4, 5}, {6, 7, 8}),
    ({2, 5, 7, 9}, 1, {2, 5, 7}, {9}),
    ({0, 1, 2, 3}, 2, {0, 1}, {2, 3}),
])
def test_split_gives_the_drafting_roles_the_last_cores(available, drafter_cores, verifier,
                                                        drafting):
    plan = cores.plan("split", drafter_cores, available)
    assert plan.split and plan.cpus("verifier") == verifier
    assert plan.cpus("drafter") == plan.cpus("datastore") == drafting
    assert plan.threads("verifier") == len(verifier) and plan.threads("drafter") == len(drafting)
    assert plan.threads("router") == 1


def test_one_core_is_shared_and_a_split_leaving_no_core_is_refused():
    assert not cores.plan("split", available={3}).split
    with pytest.raises(ValueError, match="leaves no core"):
        cores.plan("split", 2, {0, 1})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_pinned_compute_thread_runs_on_its_cores_and_gets_them_back():
    every = frozenset(os.sched_getaffinity(0))
    one = frozenset({min(every)})
    with ThreadPoolExecutor(1) as executor:
        before = cores.pin_executor(executor, one, 1)
        assert before[0] == every

        def where():
            torch.ones(256, 256) @ torch.ones(256, 256)  # a parallel op: the team exists
            return frozenset(os.sched_getaffinity(0)), torch.get_num_threads()
        assert executor.submit(where).result() == (one, 1)
        assert frozenset(os.sched_getaffinity(0)) == every  # only that thread moved
        cores.pin_executor(executor, *before)
        assert executor.submit(where).result() == before
