"""BlockManager bookkeeping."""
from __future__ import annotations

import pytest

from inference.engine import BlockManager, NoFreeBlocks


def test_allocate_free_usage() -> None:
    """Lowest ids first, usage fraction, and freed ids are reused lowest first."""
    bm = BlockManager(8)
    assert bm.num_free == 8 and bm.usage() == 0.0
    a = bm.allocate(3)
    assert a == [0, 1, 2]
    b = bm.allocate(2)
    assert b == [3, 4]
    assert bm.usage() == pytest.approx(5 / 8)
    assert bm.can_allocate(3) and not bm.can_allocate(4)
    bm.free(a)
    assert bm.allocate(4) == [0, 1, 2, 5]
    with pytest.raises(NoFreeBlocks):
        bm.allocate(3)
    assert bm.num_free == 2


def test_double_free_is_an_error() -> None:
    """Freeing a block twice would hand it to two sequences: refuse."""
    bm = BlockManager(2)
    ids = bm.allocate(1)
    bm.free(ids)
    with pytest.raises(ValueError):
        bm.free(ids)
    with pytest.raises(ValueError):
        bm.free([7])
