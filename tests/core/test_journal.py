"""The undo journal (``gpud.core.journal``) and the sorted keys (``gpud.core.sortedkeys``) against
plain models: a dict copied at each checkpoint, a sorted list."""

from __future__ import annotations

import random
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.core.journal import JDict, Journal
from gpud.core.sortedkeys import LOAD, SortedKeys

KEYS = st.sampled_from("abcdefgh")
OPS = st.lists(
    st.tuples(
        st.sampled_from(["set", "del", "pop", "setdefault", "update", "clear", "cp", "undo"]), KEYS, st.integers()
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_an_undo_puts_back_exactly_the_checkpoints_contents(ops: list[tuple[str, str, int]]) -> None:
    j = Journal()
    a: JDict[str, int] = JDict(j, lambda key: None)
    b: JDict[str, int] = JDict(j)
    cp = None
    for op, key, value in ops:
        d = a if value % 2 else b
        match op:
            case "set":
                d[key] = value
            case "del" if key in d:
                del d[key]
            case "pop":
                d.pop(key, None)
            case "setdefault":
                d.setdefault(key, value)
            case "update":
                d.update({key: value})
            case "clear" if value % 7 == 0:
                d.clear()
            case "cp":
                cp = (j.start(), dict(a), dict(b))
            case "undo" if cp is not None:
                (epoch, state), was_a, was_b = cp
                j.undo(epoch, state)
                assert a == was_a and b == was_b
    if cp is not None:
        (epoch, state), was_a, was_b = cp
        j.undo(epoch, state)
        assert (a, b) == (was_a, was_b)
        assert j.entries == 0


def test_the_hook_runs_after_each_change_made_through_the_dict_but_not_after_an_undo() -> None:
    j = Journal()
    seen: list[tuple[str, bool]] = []
    d: JDict[str, int] = JDict(j, lambda k: seen.append((k, k in d)))
    epoch, state = j.start()
    d["a"] = 1
    d.pop("a")
    d.setdefault("b", 2)
    assert seen == [("a", True), ("a", False), ("b", True)]
    assert j.undo(epoch, state) == {"a", "b"} and d == {}
    assert len(seen) == 3


def test_a_checkpoint_saves_each_key_once_and_a_newer_one_supersedes_it() -> None:
    j = Journal()
    d: JDict[str, int] = JDict(j)
    d["a"] = 0  # before any checkpoint: nothing to undo to, so nothing is saved
    assert j.entries == 0
    old = j.start()
    for i in range(100):
        d["a"] = i
    assert j.entries == 1
    j.undo(*old)
    assert d == {"a": 0}
    j.undo(*old)  # still usable after an undo
    new = j.start()
    with pytest.raises(ValueError, match="superseded"):
        j.undo(*old)
    j.undo(*new)


def test_state_names_the_state_a_checkpoint_saw() -> None:
    j = Journal()
    d: JDict[str, int] = JDict(j)
    _, s0 = j.start()
    _, s1 = j.start()
    assert s0 == s1  # nothing changed between them
    d["a"] = 1
    epoch, s2 = j.start()
    assert s2 != s1
    d["a"] = 2
    j.undo(epoch, s2)
    assert j.start()[1] == s2


def test_keep_saves_a_part_that_is_no_dict_once() -> None:
    j = Journal()
    rng = random.Random(1)
    epoch, state = j.start()
    was = rng.getstate()
    for _ in range(3):
        if not j.keeps("rng"):
            j.keep("rng", partial(rng.setstate, rng.getstate()))
        rng.random()
    assert j.entries == 1
    j.undo(epoch, state)
    assert rng.getstate() == was


def test_clear_leaves_a_dict_that_reads_fast_again() -> None:
    """Deleting key by key leaves a dict's room behind and reading it walks that room: ``clear``
    must not (the ledger's changed set is cleared after every store)."""
    j = Journal()
    d: JDict[int, None] = JDict(j)
    for i in range(50_000):
        d[i] = None
    j.start()
    d.clear()
    assert d == {} and j.entries == 50_000
    assert d.__sizeof__() < 1000


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3 * LOAD)), max_size=3000))
def test_sorted_keys_are_a_sorted_set(ops: list[tuple[bool, int]]) -> None:
    keys: SortedKeys[int] = SortedKeys()
    model: set[int] = set()
    for add, k in ops:
        if add and k not in model:
            keys.add(k)
            model.add(k)
        elif not add and k in model:
            keys.remove(k)
            model.discard(k)
    want = sorted(model)
    assert list(keys) == want and len(keys) == len(want)
    assert keys.first() == (want[0] if want else None)
    for probe in (-1, 0, LOAD, 2 * LOAD + 1, 3 * LOAD + 1):
        assert list(keys.from_(probe)) == [k for k in want if k >= probe]
        assert list(keys.after(probe)) == [k for k in want if k > probe]
        assert (probe in keys) == (probe in model)
    assert all(block for block in keys._blocks) and all(len(b) <= 2 * LOAD for b in keys._blocks)


def test_sorted_keys_refuse_a_key_twice_or_one_absent() -> None:
    keys: SortedKeys[str] = SortedKeys()
    keys.add("a")
    with pytest.raises(KeyError):
        keys.add("a")
    with pytest.raises(KeyError):
        keys.remove("b")
    keys.remove("a")
    with pytest.raises(KeyError):
        keys.remove("a")
    assert list(keys) == [] and keys.first() is None
