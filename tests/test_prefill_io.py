"""The graphed prefill's input layout (engine/prefill_graph.py), staged and written on the CPU: the
table entries a step carries (admitted requests' cached prefixes) reach the table, past the bucket's
token count too, and entries an earlier step left in the buffer do not (its copy sends only what
this step staged). The captured graphs replay the same `write_table` (tests/test_engine_gpu.py)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from constrained_spec.engine.kv_cache import RequestSlotTable
from constrained_spec.engine.prefill_graph import WRITES_PER_REQUEST, PrefillIO


def _io(tokens=16, requests=2):
    table = RequestSlotTable(max_rows=4, max_context=64, device="cpu")
    runner = SimpleNamespace(device=torch.device("cpu"), pad_row=table.pad_row, table=table)
    io = PrefillIO(runner, tokens, requests, torch.zeros(requests, 8), torch.zeros(requests, dtype=torch.int64))
    return io, table


def _stage(io, writes):
    """Two requests (rows 0 and 1): 2 new tokens at positions 48-49 of row 0, 1 at position 2 of row 1."""
    a = lambda *v: np.asarray(v, dtype=np.int64)
    io.set_inputs(a(0, 1), a(11, 12, 13), a(48, 49, 2), a(900, 901, 902), a(0, 0, 1), a(2, 1), a(50, 3), [0, 1],
                  writes)
    io.copy_inputs()
    io.write_table()


def test_carried_prefixes_reach_the_table_past_the_bucket_tokens():
    io, table = _io()
    assert io.writes == 16 + 2 * WRITES_PER_REQUEST
    flat = np.concatenate([np.arange(48), 64 + np.arange(2)])  # row 0 columns 0-47, row 1 columns 0-1
    slots = np.concatenate([100 + np.arange(48), [7, 8]])
    assert io.carries((flat, slots)) and not io.carries((np.arange(io.writes + 1), np.arange(io.writes + 1)))
    _stage(io, (flat, slots))
    assert table.device_table[0, :48].tolist() == list(range(100, 148))
    assert table.device_table[0, 48:50].tolist() == [900, 901] and table.device_table[1, :3].tolist() == [7, 8, 902]


def test_every_field_lands_in_its_device_view():
    """The copy of the staged part fills the views the captured graph reads (an offset off by one
    would feed attention another request's lengths)."""
    io, _ = _io()
    _stage(io, (np.arange(3), np.array([5, 6, 7])))
    assert io._ids[:3].tolist() == [11, 12, 13] and io._positions[:3].tolist() == [48, 49, 2]
    assert io._slots[:3].tolist() == [900, 901, 902] and io._table_rows[:3].tolist() == [0, 0, 1]
    assert io._ids[3:].eq(0).all() and io._table_rows[3:].eq(io.r.pad_row).all()
    assert io._rows.tolist() == [0, 1] and io._q_starts.tolist() == [0, 2, 3]
    assert io._q_lens.tolist() == [2, 1] and io._kv_lens.tolist() == [50, 3]
    assert io._sample_tokens.tolist() == [1, 2] and io._sample_rows.tolist() == [0, 1]
    assert io._num_writes.tolist() == [3] and io._writes[:3].tolist() == [[0, 5], [1, 6], [2, 7]]


def test_entries_of_an_earlier_step_are_not_written_again():
    io, table = _io()
    _stage(io, (np.arange(48), 100 + np.arange(48)))
    table.device_table.zero_()  # row 0 released and taken by another request meanwhile
    _stage(io, (64 + np.arange(2), np.array([7, 8])))  # the device buffer still holds the 46 entries after these
    assert table.device_table[0, :48].eq(0).all()
    assert table.device_table[1, :2].tolist() == [7, 8]
    _stage(io, None)
    assert table.device_table[0, :48].eq(0).all() and table.device_table[table.pad_row, 1:].eq(0).all()
