"""The hooks' fast walk over a unit's inputs and outputs (yashard._tree) against torch's pytree."""

import collections
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from yashard._tree import diff_leaves, is_diff_tensor, put_back


def _pytree_diff(tree):
    flat, _ = pytree.tree_flatten(tree)
    return [x for x in flat if is_diff_tensor(x)]


class Cache:  # an object pytree does not walk (as HF's DynamicCache): a leaf
    def __init__(self, t):
        self.t = t


def test_finds_the_tensors_pytree_finds_in_the_same_order_and_puts_replacements_back():
    h = torch.randn(2, 3, requires_grad=True)
    cos, sin = torch.randn(3), torch.randn(3)
    extra = torch.randn(4, requires_grad=True)
    ids = torch.arange(3)
    half = torch.randn(2, requires_grad=True).half()
    inputs = ((h,), {"attention_mask": None, "position_embeddings": (cos, sin), "position_ids": ids,
                     "cache": Cache(torch.randn(2, requires_grad=True)), "use_cache": False,
                     "extra": [1, extra, "x", torch.float32], "half": half})
    found = diff_leaves(inputs)
    assert [id(x) for x in found] == [id(x) for x in _pytree_diff(inputs)] == [id(h), id(extra), id(half)]
    new = [x.detach().clone() for x in found]
    out = put_back(inputs, iter(new))
    args, kwargs = out
    assert type(out) is tuple and type(args) is tuple and type(kwargs) is dict
    assert args[0] is new[0] and kwargs["extra"][1] is new[1] and kwargs["half"] is new[2]
    assert type(kwargs["extra"]) is list and kwargs["extra"][0] == 1 and kwargs["extra"][3] is torch.float32
    # containers without a differentiable tensor come back as the same objects
    assert kwargs["position_embeddings"] is inputs[1]["position_embeddings"]
    assert kwargs["cache"] is inputs[1]["cache"] and kwargs["attention_mask"] is None
    # the caller's containers are not changed
    assert inputs[0][0] is h and inputs[1]["extra"][1] is extra


def test_nothing_differentiable_gives_an_empty_list_and_the_same_tree():
    ids = torch.arange(4)
    frozen = torch.randn(3)  # no requires_grad
    ints = torch.ones(2, dtype=torch.long)
    tree = ((ids,), {"x": frozen, "y": (ints, None)})
    assert diff_leaves(tree) == []
    assert put_back(tree, iter([])) is tree


def test_other_pytree_containers_defer_to_pytree():
    h = torch.randn(2, requires_grad=True)
    Pair = collections.namedtuple("Pair", "a b")

    @dataclass
    class Out:
        x: torch.Tensor

    pytree.register_pytree_node(Out, lambda o: ([o.x], None), lambda xs, _: Out(xs[0]))
    try:
        for tree in [((Pair(h, 1),), {}), ((), {"o": collections.OrderedDict(a=h)}), ((Out(h),), {})]:
            assert diff_leaves(tree) is None, tree  # the caller then flattens with pytree
            assert [id(x) for x in _pytree_diff(tree)] == [id(h)]
    finally:
        pytree._deregister_pytree_node(Out)
