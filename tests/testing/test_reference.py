"""The oracle's own tests: each numbered store rule on plain token lists (no mlx)."""

from __future__ import annotations

import itertools

from blockkv.testing.reference import (
    ModelCheckpoint,
    ModelEntry,
    ReferenceStore,
    checkpoint_ns,
    common_prefix_len,
)

BIG = 1 << 30
_ids = itertools.count()


def entry(tokens: list[int], *, ns: str = "", trimmable: bool = True, mro: int = 0,
          blocks: dict[str, int] | None = None, header: int = 10) -> ModelEntry:
    return ModelEntry(id=f"e{next(_ids)}", ns=ns, tokens=tuple(tokens), trimmable=trimmable,
                      minimum_reusable_offset=mro, header_bytes=header, blocks=blocks or {})


def stored(ref: ReferenceStore, e: ModelEntry, cap: int = BIG) -> ModelEntry:
    assert ref.store(e, cap).stored
    return ref[e.id]


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


def test_find_longest_prefix_capped_below_prompt_length() -> None:
    ref = ReferenceStore()
    short = stored(ref, entry([1, 2]))
    ref.store(entry([5, 5, 5], ns="other"), BIG)
    untrim = stored(ref, entry([1, 2, 3, 4], trimmable=False))
    # An identical prompt leaves one token to forward: p = 3 < 4, untrimmable needs a trim.
    assert ref.find([1, 2, 3, 4]) == (short, 2)
    # A longer prompt matches the untrimmable entry whole.
    assert ref.find([1, 2, 3, 4, 9]) == (untrim, 4)
    assert ref.find([7, 8]) is None  # p == 0
    assert ref.find([1]) is None  # cap 0
    assert ref.find([5, 5, 5, 5], ns="other") is not None
    assert ref.find([5, 5, 5, 5]) is None  # namespaces never mix


def test_find_skips_below_minimum_reusable_offset_and_oldest_wins_ties() -> None:
    ref = ReferenceStore()
    ring = stored(ref, entry([1, 2, 3, 4, 5], mro=4))
    assert ref.find([1, 2, 3, 9]) is None  # p = 3 < 4
    assert ref.find([1, 2, 3, 4, 9]) == (ring, 4)
    a = stored(ref, entry([8, 8, 1]))
    stored(ref, entry([8, 8, 2]))
    assert ref.find([8, 8, 3]) == (a, 2)


def test_find_exact_and_durable_prefix() -> None:
    ref = ReferenceStore()
    t = stored(ref, entry([1, 2, 3, 4]))
    u = stored(ref, entry([6, 6, 6, 6], trimmable=False))
    m = stored(ref, entry([7, 7, 7, 7], mro=3))
    assert ref.find_exact([1, 2, 3, 4]) == t
    assert ref.find_exact([1, 2, 3]) is None
    assert ref.find_exact([1, 2, 3, 4], ns="x") is None
    assert ref.has_durable_prefix([1, 2])  # trimmable descendant
    assert not ref.has_durable_prefix([6, 6])  # untrimmable descendant
    assert ref.has_durable_prefix(list(u.tokens))  # equal length
    assert not ref.has_durable_prefix([7, 7])  # below its minimum reusable offset
    assert ref.has_durable_prefix([7, 7, 7])
    assert not ref.has_durable_prefix([1, 2, 3, 4, 5])  # longer than every entry
    assert ref.longest_durable_prefix_tokens == len(m.tokens)


def test_store_refuses_over_cap_and_changes_nothing() -> None:
    ref = ReferenceStore()
    keep = stored(ref, entry([1, 2], header=10), cap=100)
    out = ref.store(entry([1, 2], header=50, blocks={"a": 51}), 100)
    assert not out.stored and out.removed == ()
    assert list(ref.entries()) == [keep]


def test_store_replaces_identical_whatever_its_trimmability() -> None:
    ref = ReferenceStore()
    old = stored(ref, entry([1, 2, 3], trimmable=False))
    new = entry([1, 2, 3], trimmable=False)
    assert ref.store(new, BIG).replaced == (old.id,)
    assert ref.find_exact([1, 2, 3]).id == new.id  # type: ignore[union-attr]


def test_supersede_only_by_trimmable_and_only_prefixes_at_least_its_offset() -> None:
    ref = ReferenceStore()
    p1 = stored(ref, entry([1], trimmable=False))
    p2 = stored(ref, entry([1, 2], trimmable=False))
    p3 = stored(ref, entry([1, 2, 3], trimmable=False))
    other_ns = stored(ref, entry([1, 2], ns="x"))
    sibling = stored(ref, entry([1, 9], trimmable=False))
    assert len(ref) == 5  # untrimmable entries supersede nothing
    untrim = entry([1, 2, 3, 4], trimmable=False)
    assert ref.store(untrim, BIG).superseded == ()
    out = ref.store(entry([1, 2, 3, 4, 5], mro=2), BIG)
    assert set(out.superseded) == {p2.id, p3.id, untrim.id}
    assert p1.id in ref and other_ns.id in ref and sibling.id in ref
    assert p2.id not in ref and p3.id not in ref


def test_lru_eviction_counts_shared_blocks_once() -> None:
    ref = ReferenceStore()
    a = stored(ref, entry([1], header=10, blocks={"x": 100, "s": 50}))
    b = stored(ref, entry([2], header=10, blocks={"y": 100, "s": 50}))
    assert ref.total_bytes == 10 + 10 + 100 + 100 + 50
    ref.touch(a.id)  # b is now the least recently used
    c = entry([3], header=10, blocks={"z": 100, "s": 50})
    out = ref.store(c, 300)
    assert out.evicted == (b.id,)
    assert ref.total_bytes == 10 + 10 + 100 + 100 + 50 <= 300
    assert ref.evict_to_cap(200) == (a.id,)
    assert [e.id for e in ref.entries()] == [c.id]
    assert ref.evict_to_cap(0) == (c.id,) and len(ref) == 0


def test_generation_checkpoints_own_namespace_and_supersede_their_key() -> None:
    ref = ReferenceStore()
    prompt = [1, 2, 3]
    ck = ModelCheckpoint(key="req", original_prompt_tokens=3)
    first = entry([1, 2, 3, 10, 11], trimmable=False)
    assert ref.store_generation_checkpoint(first, ck, BIG).stored
    other = entry([1, 2, 3, 10], trimmable=False)
    ref.store_generation_checkpoint(other, ModelCheckpoint("other", 3), BIG)
    assert ref.find(prompt + [10, 11, 12]) is None  # never seeds a plain prefill
    assert ref[first.id].ns == checkpoint_ns("req")
    assert ref.find_generation_checkpoint(prompt, "req").id == first.id  # type: ignore[union-attr]
    assert ref.find_generation_checkpoint(prompt, "req", cache_ns="ns") is None
    assert ref.find_generation_checkpoint([1, 2], "req") is None  # prompt length differs
    second = entry([1, 2, 3, 10, 11, 12], trimmable=False)
    out = ref.store_generation_checkpoint(second, ck, BIG)
    assert out.superseded == (first.id,)
    assert ref.find_generation_checkpoint(prompt, "req").id == second.id  # type: ignore[union-attr]
    assert ref.remove_generation_checkpoints("req") == (second.id,)
    assert other.id in ref
