"""Majority-voted speculator (Minions 3.2): the figure-5 example by hand, reward/punish updates."""
import pytest

from specmesh_services.common.tree import TokenTree
from specmesh_services.router.voting import (MajorityVoter, VotingConfig, choose_tree, majority_vote,
                                    merge, verify_union)

# Figure 5 is an image; its text gives: S_u6 = (u1, u3, u6); w_u2 = w1 + w2 because SSM1 and
# SSM2 both generate 'like'; 'like' beats 'likes' as w1 + w2 > w3; 'apple' beats 'pear' as
# w1 > w2; S_u4 is the majority-approved output. So u1 is the prompt token (our root), SSM1 =
# (like, apple) ending at u4, SSM2 = (like, pear) ending at u5, SSM3 = (likes, u6). The word
# at u6 is not in the text; any token will do (here 'apples').
VOCAB = {"like": 10, "likes": 11, "apple": 20, "pear": 21, "apples": 22}
SSM1 = [VOCAB["like"], VOCAB["apple"]]
SSM2 = [VOCAB["like"], VOCAB["pear"]]
SSM3 = [VOCAB["likes"], VOCAB["apples"]]
# w1 + w2 > w3 and w1 > w2, with w3 the largest single weight: the majority, not the heaviest
# drafter, decides.
W = {"ssm1": 0.5, "ssm2": 0.3, "ssm3": 0.6}


def _node(tree: TokenTree, path_words: list[str]) -> int:
    """Index of the node reached from the root by `path_words`."""
    parent = -1
    for word in path_words:
        parent = next(i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents))
                      if t == VOCAB[word] and p == parent)
    return parent


def test_figure5_tree_weights_and_majority_path():
    vote = majority_vote({"ssm1": SSM1, "ssm2": SSM2, "ssm3": SSM3}, W)
    tree = vote.union
    assert len(tree) == 5  # u2..u6 (u1 is the root, the last accepted token)
    u2, u3 = _node(tree, ["like"]), _node(tree, ["likes"])
    u4, u5 = _node(tree, ["like", "apple"]), _node(tree, ["like", "pear"])
    u6 = _node(tree, ["likes", "apples"])
    # node weight = sum of the weights of the drafters through it, by hand
    assert tree.scores[u2] == pytest.approx(0.5 + 0.3)  # w_u2 = w1 + w2
    assert tree.scores[u3] == pytest.approx(0.6)  # w3
    assert tree.scores[u4] == pytest.approx(0.5)  # w1
    assert tree.scores[u5] == pytest.approx(0.3)  # w2
    assert tree.scores[u6] == pytest.approx(0.6)  # w3
    assert tree.parents[u4] == tree.parents[u5] == u2 and tree.parents[u6] == u3
    assert tree.parents[u2] == tree.parents[u3] == -1
    assert set(vote.supporters[u2]) == {"ssm1", "ssm2"} and vote.supporters[u6] == ("ssm3",)
    # 'like' (0.8) over 'likes' (0.6), then 'apple' (0.5) over 'pear' (0.3): S_final = S_u4
    assert vote.path == (u2, u4)
    assert vote.tokens == tuple(SSM1)
    assert vote.voted == "ssm1"
    assert vote.extra_nodes == 3
    chain = vote.path_tree()
    assert chain.tokens == tuple(SSM1) and chain.parents == (-1, 0)
    assert chain.source_names == ("ssm1",) and chain.scores == pytest.approx((0.8, 0.5))


def test_union_matches_token_tree_union_of_chains():
    seqs = {"ssm1": SSM1, "ssm2": SSM2, "ssm3": SSM3}
    tree, _ = merge(seqs, W)
    ref = TokenTree.union([TokenTree.chain(s, source=n) for n, s in seqs.items()])
    assert tree.tokens == ref.tokens and tree.parents == ref.parents
    assert tree.source_names == ("ssm1", "ssm2", "ssm3")


def test_heaviest_single_drafter_wins_when_it_outweighs_the_rest():
    vote = majority_vote({"ssm1": SSM1, "ssm2": SSM2, "ssm3": SSM3},
                         {"ssm1": 0.5, "ssm2": 0.3, "ssm3": 0.9})
    assert vote.voted == "ssm3" and vote.tokens == tuple(SSM3)


def test_ties_break_by_drafter_order_and_identical_sequences_vote_the_heaviest():
    assert majority_vote({"a": [1, 2], "b": [3, 4]}, {"a": 1.0, "b": 1.0}).voted == "a"
    assert majority_vote({"b": [3, 4], "a": [1, 2]}, {"a": 1.0, "b": 1.0}).voted == "b"
    vote = majority_vote({"a": [1, 2], "b": [1, 2], "c": [5]}, {"a": 0.2, "b": 0.3, "c": 0.4})
    assert vote.voted == "b" and vote.tokens == (1, 2) and len(vote.union) == 3


def test_uneven_lengths_descend_to_a_leaf():
    # 'a' stops at depth 1 inside b's path; the descent goes on to b's leaf
    vote = majority_vote({"a": [1], "b": [1, 2, 3], "c": [4]}, {"a": 1.0, "b": 0.5, "c": 1.2})
    assert vote.tokens == (1, 2, 3) and vote.voted == "b"


def test_nothing_drafted():
    vote = majority_vote({"a": [], "b": []}, {"a": 1.0, "b": 1.0})
    assert vote.path == () and vote.voted is None and len(vote.union) == 0
    assert len(vote.path_tree()) == 0


def test_judge_counts_each_drafters_tokens_against_the_emitted_ones():
    vote = majority_vote({"ssm1": SSM1, "ssm2": SSM2, "ssm3": SSM3}, W)
    # target emitted 'like' (accepted) then 'pear' (bonus: not ssm1's 'apple')
    emitted = [VOCAB["like"], VOCAB["pear"]]
    assert vote.judge(emitted) == {"ssm1": (1, 2), "ssm2": (2, 2), "ssm3": (0, 2)}
    # both path tokens accepted, then a bonus
    assert vote.judge(SSM1 + [99])["ssm1"] == (2, 2)
    # a longer drafter whose tail was never judged
    long_vote = majority_vote({"a": [1], "b": [1, 2, 3]}, {"a": 2.0, "b": 1.0})
    assert long_vote.voted == "b"
    assert long_vote.judge([1, 2])["b"] == (2, 2)
    assert long_vote.judge([1, 7])["b"] == (1, 3)


def test_verify_union_decision():
    vote = majority_vote({"ssm1": SSM1, "ssm2": SSM2, "ssm3": SSM3}, W)  # 3 extra nodes
    assert verify_union(vote, seconds_per_node=1e-4, max_extra_seconds=3.01e-4)
    assert not verify_union(vote, seconds_per_node=1e-4, max_extra_seconds=2.9e-4)
    assert choose_tree(vote, 1e-4, 1e-3) is vote.union
    assert choose_tree(vote, 1e-2, 1e-3).tokens == tuple(SSM1)
    single = majority_vote({"a": [1, 2]}, {"a": 1.0})
    assert not verify_union(single, 0.0, 1.0)  # nothing extra: the path is the union


# ---------------------------------------------------------------------------------------------
# reward / punish
CFG = VotingConfig(reward_threshold=0.7, punish_threshold=0.3, reward_factor=1.5,
                   punish_factor=0.5)


def test_acr_of_figure5_outputs_and_weight_update():
    voter = MajorityVoter(["ssm1", "ssm2", "ssm3"], CFG)
    # "o_SSM1 = {o1, o3, o4}": four verified outputs, ssm1 voted for three, ssm2 for o2
    voter.record("ssm1", 4, 4)  # o1: rate 1.0
    voter.record("ssm2", 1, 4)  # o2: rate 0.25
    voter.record("ssm1", 2, 4)  # o3: rate 0.5
    voter.record("ssm1", 3, 4)  # o4: rate 0.75
    acrs = voter.update()
    assert acrs == pytest.approx({"ssm1": (1.0 + 0.5 + 0.75) / 3, "ssm2": 0.25})  # eq. 1
    assert voter.weights["ssm1"] == pytest.approx(1.5)  # 0.75 > 0.7: rewarded
    assert voter.weights["ssm2"] == pytest.approx(0.5)  # 0.25 < 0.3: punished
    assert voter.weights["ssm3"] == pytest.approx(1.0)  # no output voted: unchanged
    # next batch: between the thresholds, nothing changes
    voter.record("ssm1", 2, 4)
    assert voter.update() == pytest.approx({"ssm1": 0.5})
    assert voter.weights["ssm1"] == pytest.approx(1.5)


def test_thresholds_are_strict():
    voter = MajorityVoter(["a", "b"], CFG)
    voter.record("a", 7, 10)  # exactly reward_threshold: not exceeded
    voter.record("b", 3, 10)  # exactly punish_threshold: not below
    voter.update()
    assert voter.weights == pytest.approx({"a": 1.0, "b": 1.0})


def test_observe_credits_the_voted_drafter_only_and_weights_shift_the_vote():
    voter = MajorityVoter(["ssm1", "ssm2", "ssm3"], CFG)
    voter.weights.update(W)
    seqs = {"ssm1": SSM1, "ssm2": SSM2, "ssm3": SSM3}
    # the target keeps rejecting ssm1's path at the first token and emitting 'likes'
    for _ in range(3):
        vote = voter.vote(seqs)
        if vote.voted != "ssm1":
            break
        voter.observe(vote, [VOCAB["likes"]])
        acrs = voter.update()
        assert set(acrs) == {"ssm1"} and acrs["ssm1"] == 0.0  # others not credited
    # 0.5 * 0.5 = 0.25; 0.25 + 0.3 < 0.6: 'likes' now carries the majority
    assert voter.weights["ssm1"] == pytest.approx(0.25)
    assert voter.vote(seqs).voted == "ssm3"


def test_credit_all_and_weight_clamp():
    cfg = VotingConfig(reward_threshold=0.7, punish_threshold=0.3, reward_factor=2.0,
                       punish_factor=0.1, min_weight=0.05, max_weight=3.0, credit_all=True)
    voter = MajorityVoter(["ssm1", "ssm2", "ssm3"], cfg)
    seqs = {"ssm1": SSM1, "ssm2": SSM2, "ssm3": SSM3}
    for _ in range(3):
        voter.observe(voter.vote(seqs), [VOCAB["like"], VOCAB["pear"], 7])
        voter.update()
    # ssm2 fully accepted each time (rewarded, capped at 3), ssm1 half (unchanged),
    # ssm3 none (punished, floored at 0.05)
    assert voter.weights == pytest.approx({"ssm1": 1.0, "ssm2": 3.0, "ssm3": 0.05})


def test_config_and_input_checks():
    with pytest.raises(ValueError):
        VotingConfig(reward_threshold=0.2, punish_threshold=0.5)
    with pytest.raises(ValueError):
        VotingConfig(reward_factor=0.9)
    with pytest.raises(ValueError):
        MajorityVoter(["a", "a"])
    voter = MajorityVoter(["a"])
    with pytest.raises(ValueError):
        voter.vote({"z": [1]})
    with pytest.raises(ValueError):
        voter.record("a", 3, 2)
