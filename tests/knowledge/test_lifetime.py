"""The reference-counted lifetime a knowledge base composes: reads hold it, close waits for them, then refuses."""

import threading

import pytest

from rag.knowledge.lifetime import Lifetime
from rag.utils.errors import KnowledgeBaseError


def test_close_waits_for_the_reads_then_refuses_new_ones():
    life = Lifetime("kb/: knowledge base v1")
    entered, leave = threading.Event(), threading.Event()

    def read():
        with life.hold():
            with life.hold():  # nests
                entered.set()
                leave.wait(30)

    reader = threading.Thread(target=read)
    reader.start()
    assert entered.wait(30) and life.in_flight == 2
    assert life.close(timeout=0) is False and not life.closed  # a read runs: nothing changes
    leave.set()
    assert life.close(timeout=30) is True and life.closed and life.in_flight == 0
    reader.join(30)
    assert life.close() is None  # already closed
    with pytest.raises(KnowledgeBaseError, match="kb/: knowledge base v1 was closed"):
        with life.hold():
            pass
    with life.hold_if_open() as held:
        assert held is False and life.in_flight == 0
