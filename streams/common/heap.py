"""Keeps CPython's full garbage collections off the decision path.

The worker holds its state decoded in memory (``streams/worker/tablestate.py``): some 150,000
container objects for 1,000 VMs. CPython runs a full collection each time a quarter as
many objects again have survived the young generations, and each full collection walks
every tracked object: under load, a pause of the event loop every second or two, and most
of the worker's p99 latency (``docs/worker.md``, "Latency").

So, as many long-running Python services do, the worker *freezes* what has survived:
``gc.freeze()`` moves every tracked object into CPython's permanent generation, which
collections skip. Each :meth:`Heap.freeze_survivors` first collects the young generations
(young cycles are freed, not frozen) and then freezes the rest; the full collections
CPython still starts then walk only what survived since, a few thousand objects.

Young collections are made rarer too: CPython starts one each time 700 more container
objects were allocated than freed, and a batch of 500 inputs keeps thousands alive until
it is done, so the worker ran one every millisecond or so, each walking what the batch
holds (``benchmarks/README.md``, worker_throughput).
From the first :meth:`Heap.tend` on the threshold is :data:`YOUNG_OBJECTS`; objects freed by
reference counting in between are never walked at all.

The price: a cycle that becomes garbage after it was frozen is not freed until the next
:meth:`Heap.collect_all`, which thaws everything and runs a full collection, once every
``full_every`` seconds. Objects freed by reference counting (nearly all of them: replaced
table values, sent messages) are freed at once, frozen or not.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from streams.common import metrics

YOUNG_OBJECTS = 10_000  # allocations less deallocations between young collections (CPython: 700)


class Heap:
    """The worker's collection policy: freeze survivors often, collect everything rarely."""

    def __init__(self, full_every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.full_every = full_every
        self.clock = clock
        self.last_full: float | None = None  # None: nothing frozen yet
        self._started: dict[int, float] = {}

    def watch(self) -> None:
        """Time every collection into ``vmstream_gc_pause_seconds``; count the frozen objects
        into ``vmstream_gc_frozen_objects`` when it is read. Counting walks CPython's list of
        frozen objects, millions after a burst: counted when scraped, not on each
        :meth:`freeze_survivors`, it does not pause the event loop once a second."""
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)
        metrics.GC_FROZEN.set_function(gc.get_freeze_count)

    def unwatch(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def tend(self) -> None:
        """Called on a timer: a full collection when one is due, else freeze the survivors.

        The first call starts the policy: pauses are timed from then on."""
        if self.last_full is None:
            self.watch()
            gc.set_threshold(YOUNG_OBJECTS, *gc.get_threshold()[1:])
        if self.last_full is None or self.clock() - self.last_full >= self.full_every:
            self.collect_all()
        else:
            self.freeze_survivors()

    def freeze_survivors(self) -> None:
        gc.collect(1)  # young cycles are garbage now or live long: free the former first
        gc.freeze()

    def collect_all(self) -> None:
        """Thaw, collect every generation (frees cycles that died frozen), freeze again."""
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.last_full = self.clock()

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if phase == "start":
            self._started[generation] = time.perf_counter()
        elif (started := self._started.pop(generation, None)) is not None:
            metrics.GC_PAUSE_SECONDS.labels(str(generation)).observe(time.perf_counter() - started)
