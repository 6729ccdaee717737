"""The K-invariant tree sum: K ranks' subtree sums added in tree order equal the one-rank tree sum bit
for bit (hypothesis, random fp32 data)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from perparam.sharding.tree_sum import TreeStack, tree_sum

pytestmark = pytest.mark.fast


@settings(max_examples=60, deadline=None)
@given(log_u=st.integers(0, 6), log_k=st.integers(0, 6), n=st.integers(1, 33), seed=st.integers(0, 2**31))
def test_subtree_sums_added_in_tree_order_equal_the_one_rank_tree_sum_bitwise(log_u, log_k, n, seed):
    u, k = 2**log_u, 2**min(log_k, log_u)
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(n, generator=g) * 10 ** torch.randint(-8, 8, (n,), generator=g) for _ in range(u)]
    whole = tree_sum(leaves)
    per = u // k
    subtrees = [tree_sum(leaves[r * per:(r + 1) * per]) for r in range(k)]
    assert torch.equal(tree_sum(subtrees).view(torch.int32), whole.view(torch.int32))


@settings(max_examples=40, deadline=None)
@given(log_u=st.integers(0, 6), n=st.integers(1, 33), seed=st.integers(0, 2**31))
def test_odd_leaves_added_into_their_taken_left_sibling_give_the_tree_sum_bitwise_holding_log2_sums(
        log_u, n, seed):
    # perparam.invariant seeds the accumulator of an odd unit with its left sibling (take_leaf), the backward
    # adds the unit's gradient into it, and the sum goes back as a level-1 node: one partial sum less held
    u = 2**log_u
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(n, generator=g) * 10 ** torch.randint(-8, 8, (n,), generator=g) for _ in range(u)]
    stack, most = TreeStack(lambda a, b: a.add_(b)), 0
    for leaf in leaves:
        left = stack.take_leaf()
        most = max(most, stack.depth + 1)  # the partial sums and the accumulator the backward writes
        if left is None:
            stack.push(leaf.clone())
        else:
            stack.push(left.add_(leaf), level=1)
    assert most <= max(log_u, 1)
    assert torch.equal(stack.result().view(torch.int32),
                       tree_sum([t.clone() for t in leaves]).view(torch.int32))


def test_the_binary_counter_stack_holds_at_most_log2_plus_one_partial_sums():
    stack, most = TreeStack(), 0
    for i in range(64):
        stack.push(float(i))
        most = max(most, stack.depth)
    assert most <= 7 and stack.result() == sum(range(64))


@pytest.mark.parametrize("kw", [{"foreach": False}, {"foreach": True}, {"fused": True}])
def test_adamw_step_is_bitwise_independent_of_where_a_shard_starts_and_ends(kw):
    torch.manual_seed(0)
    w, grads = torch.randn(1037), [torch.randn(1037) for _ in range(5)]
    whole, a, b = (torch.nn.Parameter(t.clone()) for t in (w, w[:13], w[13:]))  # 13: inside a vector
    o1, o2 = torch.optim.AdamW([whole], lr=1e-2, **kw), torch.optim.AdamW([a, b], lr=1e-2, **kw)
    for g in grads:
        whole.grad, a.grad, b.grad = g.clone(), g[:13].clone(), g[13:].clone()
        o1.step()
        o2.step()
    assert torch.equal(whole.detach(), torch.cat([a.detach(), b.detach()]))


def test_a_left_sibling_seeded_as_accumulator_and_added_to_twice_in_a_unit_is_refused_naming_the_parameter():
    # perparam.invariant seeds an odd unit's accumulator with its left sibling; a gradient arriving in two
    # pieces ((left + g1) + g2, a parameter used again after its group's backward) is not the tree's sum
    from types import SimpleNamespace

    from perparam.invariant import InvariantError, _sibling_sum

    p = SimpleNamespace(path="blocks.0.fc1.weight")
    left = torch.tensor([-0.0, 1.0])
    v = left._version
    # no gradient: left + 0, as a zero leaf
    assert torch.equal(_sibling_sum(p, left, v), torch.tensor([0.0, 1.0]))
    acc = torch.ones(2)
    v = acc._version
    acc.add_(1.0)
    assert _sibling_sum(p, acc, v) is acc  # one addition: the tree's left + leaf
    acc.add_(1.0)
    with pytest.raises(InvariantError, match="blocks.0.fc1.weight"):
        _sibling_sum(p, acc, v)
