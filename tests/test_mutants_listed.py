"""tests/mutants.py stays usable (issue 24): every mutation's patch still finds its text in the product, and the test
files it runs exist. The mutation run itself is too slow for the suite (see tests/mutants.py's docstring)."""
from __future__ import annotations

import os

import pytest

from tests import mutants


@pytest.mark.parametrize("mutation", mutants.MUTATIONS, ids=[m.name for m in mutants.MUTATIONS])
def test_every_mutation_still_applies(mutation):
    for rel, old, new in mutation.patches:
        with open(os.path.join(mutants.ROOT, rel), encoding="utf-8") as fh:
            count = fh.read().count(old)
        assert count == 1 or (count > 1 and old.endswith("(")), f"{mutation.name}: {rel} holds the text {count} times"
        assert old != new
    for test in mutation.tests:
        assert os.path.isfile(os.path.join(mutants.ROOT, test.split("::")[0])), test


def test_mutation_names_are_unique():
    names = [m.name for m in mutants.MUTATIONS]
    assert len(names) == len(set(names))
