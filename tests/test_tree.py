"""Token tree form and compiler, on small trees checked by hand."""
import pytest
import torch

from specmesh_services.common.tree import TokenTree, compile_tree


def test_chain_parents_and_depths():
    tree = TokenTree.chain([5, 6, 7], source="d")
    assert tree.parents == (-1, 0, 1)
    assert tree.depths() == [1, 2, 3]
    assert tree.sources == (0, 0, 0) and tree.source_names == ("d",)


def test_compile_five_node_tree_by_hand():
    #        root(9)
    #       /       \
    #     a(1)      b(2)
    #    /   \        \
    #  c(3)  d(4)     e(5)
    tree = TokenTree(tokens=(1, 2, 3, 4, 5), parents=(-1, -1, 0, 0, 1))
    c = compile_tree(tree, root_token=9)
    assert c.tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert c.depths.tolist() == [0, 1, 1, 2, 2, 2]
    expected = torch.tensor([
        # root a  b  c  d  e
        [1, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0],  # a
        [1, 0, 1, 0, 0, 0],  # b
        [1, 1, 0, 1, 0, 0],  # c
        [1, 1, 0, 0, 1, 0],  # d
        [1, 0, 1, 0, 0, 1],  # e
    ], dtype=torch.bool)
    assert torch.equal(c.ancestors, expected)
    assert c.children == [[1, 2], [3, 4], [5], [], [], []]
    assert tree.path_to(3) == [0, 3]
    assert tree.leaves() == [2, 3, 4]


def test_empty_tree_compiles_to_root_only():
    c = compile_tree(TokenTree(), root_token=4)
    assert c.tokens.tolist() == [4] and c.ancestors.tolist() == [[True]] and c.children == [[]]


@pytest.mark.parametrize("tokens,parents,message", [
    ((1, 2), (-1,), "parents"),
    ((1, 2), (-1, 1), "parents must come before"),
    ((1,), (-2,), "parents must come before"),
])
def test_malformed_trees_are_rejected(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        TokenTree(tokens=tokens, parents=parents)


def test_scores_must_match_nodes_and_vocab_is_checked():
    with pytest.raises(ValueError, match="scores"):
        TokenTree(tokens=(1, 2), parents=(-1, 0), scores=(0.5,))
    with pytest.raises(ValueError, match="vocabulary"):
        TokenTree.chain([1, 99]).check_vocab(50)


def test_protobuf_round_trip():
    tree = TokenTree(tokens=(1, 2, 3), parents=(-1, 0, -1), scores=(0.1, 0.2, 0.3),
                     sources=(0, 0, 1), source_names=("x", "y"))
    back = TokenTree.from_pb(tree.to_pb())
    assert back.tokens == tree.tokens and back.parents == tree.parents
    assert back.sources == tree.sources and back.source_names == tree.source_names
    assert back.scores == pytest.approx(tree.scores)
