"""The worker's collection policy: survivors frozen often, everything collected rarely."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from streams.common import metrics
from streams.common.heap import YOUNG_OBJECTS, Heap


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Node:
    """A weakly referenceable object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def heap(clock: Clock) -> Iterator[Heap]:
    heap = Heap(full_every=600.0, clock=clock)
    thresholds = gc.get_threshold()
    try:
        yield heap
    finally:  # this test process must not keep a frozen heap, nor rarer collections
        heap.unwatch()
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def pause_samples(generation: int) -> float:
    value = metrics.GC_PAUSE_SECONDS.labels(str(generation))._sum.get()
    return float(value)


def test_the_first_tend_collects_everything_and_freezes_what_lives(heap: Heap, clock: Clock) -> None:
    garbage = cycle()
    heap.tend()
    assert garbage() is None  # the full collection freed it
    assert gc.get_freeze_count() > 0 and heap.last_full == 0.0


def test_survivors_are_frozen_between_full_collections(heap: Heap, clock: Clock) -> None:
    heap.tend()
    frozen = gc.get_freeze_count()
    kept = [Node() for _ in range(1_000)]
    clock.now = 1.0
    heap.tend()
    # Frozen objects still die by reference counting, on any thread (a test before may have
    # left one running): a few of the earlier ones may be gone; without the freeze, all of
    # the 1,000 would be missing.
    assert gc.get_freeze_count() - frozen >= len(kept) - len(kept) // 10
    assert heap.last_full == 0.0  # no full collection yet
    assert gc.get_objects(generation=2) == []  # nothing left for CPython's full collections to walk


def test_young_garbage_is_freed_not_frozen(heap: Heap, clock: Clock) -> None:
    heap.tend()
    clock.now = 1.0
    garbage = cycle()
    heap.tend()
    assert garbage() is None


def test_a_cycle_that_dies_frozen_waits_for_the_next_full_collection(heap: Heap, clock: Clock) -> None:
    heap.tend()
    alive = cycle()
    strong = alive()
    clock.now = 1.0
    heap.tend()  # frozen while referenced
    del strong
    gc.collect()  # CPython's own full collections skip the permanent generation
    assert alive() is not None
    clock.now = 599.0
    heap.tend()
    assert alive() is not None
    clock.now = 600.0
    heap.tend()  # full_every has passed: thaw, collect, freeze
    assert alive() is None and heap.last_full == 600.0


def test_collection_pauses_are_measured_by_generation(heap: Heap) -> None:
    before = pause_samples(2)
    heap.tend()
    assert pause_samples(2) > before


def test_young_collections_are_made_rarer_from_the_first_tend(heap: Heap) -> None:
    older = gc.get_threshold()[1:]
    heap.tend()
    assert gc.get_threshold() == (YOUNG_OBJECTS, *older)


def frozen_gauge() -> float:
    [sample] = [s for m in metrics.GC_FROZEN.collect() for s in m.samples]
    return float(sample.value)


def frozen_now() -> float:
    """The gauge, checked against the count read just before and just after it. Frozen objects
    still die by reference counting, on any thread, so the count may only fall meanwhile."""
    before = gc.get_freeze_count()
    read = frozen_gauge()
    assert gc.get_freeze_count() <= read <= before
    return read


def test_the_frozen_count_is_taken_when_the_gauge_is_read_not_on_each_freeze(heap: Heap, clock: Clock) -> None:
    """Counting walks every frozen object (29 ms for two million): read, not kept up to date."""
    heap.tend()
    assert frozen_now() > 0
    kept = [Node() for _ in range(1_000)]
    clock.now = 1.0
    heap.tend()
    assert frozen_now() >= len(kept)
    gc.unfreeze()
    assert frozen_gauge() == 0  # read now, not as of the last tend
