"""The stored Responses (`server/response_store.py`): kept, found and deleted by id, bounded by
count and by bytes with the least recently used dropped first."""
from __future__ import annotations

import pytest

from constrained_spec.server.response_store import ResponseStore

MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


def test_put_get_delete_by_id():
    store = ResponseStore()
    store.put("resp_a", {"id": "resp_a", "output": []}, MESSAGES)
    assert store.get("resp_a") == ({"id": "resp_a", "output": []}, MESSAGES)
    assert store.get("resp_b") is None
    assert store.delete("resp_a") and not store.delete("resp_a")
    assert store.get("resp_a") is None and len(store) == 0


def test_oldest_unused_go_first_past_the_count():
    store = ResponseStore(max_responses=2)
    store.put("a", {"id": "a"}, [])
    store.put("b", {"id": "b"}, [])
    assert store.get("a") is not None  # used: b is now the least recently used
    store.put("c", {"id": "c"}, [])
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None


def test_bounded_by_bytes():
    store = ResponseStore(max_bytes=400)
    big = [{"role": "user", "content": "x" * 150}]
    for name in "abc":
        store.put(name, {"id": name}, big)
    assert store.get("a") is None and store.get("c") is not None
    assert store._bytes <= 400
    store.put("huge", {"id": "huge"}, [{"role": "user", "content": "x" * 1000}])  # larger than the store
    assert store.get("huge") is None and store.get("c") is not None
    store.put("c", {"id": "c"}, [])  # replacing an entry counts its new size only
    assert store._bytes == sum(len(b) for b in store._entries.values())


def test_call_by_name():
    store = ResponseStore()
    store.call("put", "r", ({"id": "r"}, MESSAGES))
    assert store.call("get", "r") == ({"id": "r"}, MESSAGES)
    assert store.call("delete", "r") is True
    with pytest.raises(ValueError, match="unknown response store operation"):
        store.call("list", "r")
