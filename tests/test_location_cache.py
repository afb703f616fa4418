"""The module path of a captured call, cached per chain of modules (npu_agent/location.py, issue 25 goal 2): a hit
gives what the walk gives, a module reached through two parents gets each path, and freeing a module of a cached
path empties the cache before its id can be reused by another module."""
from __future__ import annotations

import gc

import torch.nn as nn

from npu_agent import location


class Leaf(nn.Module):
    def forward(self, probe):
        return probe()


class Pair(nn.Module):
    def __init__(self, shared: Leaf) -> None:
        super().__init__()
        self.first, self.second = Leaf(), shared

    def forward(self, probe):
        return self.first(probe), self.second(probe)


class Top(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = Leaf()
        self.left, self.right = Pair(shared), Pair(shared)

    def forward(self, probe):
        return self.left(probe), self.right(probe)


def _paths(model: nn.Module) -> list[str]:
    seen: list[str] = []
    location.install()
    try:
        model(lambda: seen.append(location.module_path()))
    finally:
        location.uninstall()
    return seen


def test_cached_paths_are_the_walked_paths_and_a_shared_module_gets_each_parent():
    location._PATHS.clear()
    model = Top()
    expect = ["Top.left.first", "Top.left.second", "Top.right.first", "Top.right.second"]
    assert _paths(model) == expect          # walked, then cached
    assert len(location._PATHS) == 4
    assert _paths(model) == expect          # from the cache


def test_freeing_a_module_of_a_cached_path_empties_the_cache():
    location._PATHS.clear()
    model = Top()
    assert _paths(model)[0] == "Top.left.first"
    assert location._PATHS
    model.left.first = Leaf()               # the old child is freed: its id may go to another module
    gc.collect()
    assert not location._PATHS
    assert _paths(model)[0] == "Top.left.first"
