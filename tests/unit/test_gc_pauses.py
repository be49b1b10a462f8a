"""The collector kept off the serving path (engine/gc_pauses.py): a service freezes its start-up heap, so that a
full collection walks only what serving made since, and the pauses the collector still makes are counted."""

import gc
import weakref

from deltamesh.engine.gc_pauses import GcPauses, freeze_startup_heap


class _Cycle:
    def __init__(self):
        self.me = self


def test_a_frozen_heap_is_left_out_of_later_collections_and_new_garbage_still_goes():
    before = len(gc.get_objects())
    pauses = GcPauses()
    try:
        frozen = freeze_startup_heap()
        assert frozen.objects >= before // 2 and len(gc.get_objects()) < before // 10  # what a full collection walks
        # the start-up collection is timed for the serving line, and is no pause of the serving path
        assert frozen.collect_ms > 0 and pauses.take() == (0.0, 0.0, 0)
        assert pauses.counting  # again after it
        _Cycle()  # garbage made after the freeze: only the collector frees a cycle
        assert gc.collect() >= 1
        total, longest, full = pauses.take()
        assert full == 1 and total >= longest > 0
        assert pauses.take() == (0.0, 0.0, 0)  # counted anew after each take
    finally:
        pauses.close()
        gc.unfreeze()  # this test process goes on with other tests
    assert len(gc.get_objects()) >= before // 2


def test_a_counter_never_closed_leaves_the_collector_with_its_owner():
    """The collector's list holds no strong reference: a counter dropped without close (a test's step report) goes,
    and its hook with it."""
    hooks = len(gc.callbacks)
    pauses = GcPauses()
    gone = weakref.ref(pauses)
    assert pauses.counting and len(gc.callbacks) == hooks + 1
    del pauses
    assert gone() is None and len(gc.callbacks) == hooks
