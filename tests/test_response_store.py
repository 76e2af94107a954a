"""The stored Responses (`server/response_store.py`): kept, found and deleted by id, bounded by
count and by bytes with the least recently used dropped first; the input items a stored response
lists (`responses.input_items`, `items_page`)."""
from __future__ import annotations

import pytest

from constrained_spec.server.response_store import ResponseStore



def test_put_get_delete_by_id():
    store = ResponseStore()
    store.put("resp_a", b"[1]")
    assert store.get("resp_a") == b"[1]" and store.get("resp_b") is None
    assert store.delete("resp_a") and not store.delete("resp_a")
    assert store.get("resp_a") is None and len(store) == 0


def test_oldest_unused_go_first_past_the_count():
    store = ResponseStore(max_responses=2)
    store.put("a", b"a")
    store.put("b", b"b")
    assert store.get("a") is not None  # used: b is now the least recently used
    store.put("c", b"c")
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None


def test_bounded_by_bytes():
    store = ResponseStore(max_bytes=400)
    for name in "abc":
        store.put(name, b"x" * 150)
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    assert store.snapshot() == {"responses": 2, "bytes": 300}
    store.put("huge", b"x" * 1000)  # larger than the store: not kept, and nothing else dropped for it
    assert store.get("huge") is None and store.snapshot() == {"responses": 2, "bytes": 300}
    store.put("c", b"x" * 10)  # replacing an entry counts its new size only
    assert store.snapshot() == {"responses": 2, "bytes": 160}


def test_call_by_name():
    store = ResponseStore()
    store.call("put", "r", b"[]")
    assert store.call("get", "r") == b"[]"
    assert store.call("delete", "r") is True
    with pytest.raises(ValueError, match="unknown response store operation"):
        store.call("list", "r")


def test_input_items_and_their_pages():
    from constrained_spec.server.errors import APIError
    from constrained_spec.server.responses import ResponsesRequest, input_items, items_page
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok", "id": "fco_mine"}]})
    items = input_items(req)
    assert [i["type"] for i in items] == ["message", "message", "function_call", "function_call_output"]
    assert items[0]["content"] == [{"type": "input_text", "text": "a"}] and items[0]["id"].startswith("msg")
    assert items[2]["id"].startswith("fc") and items[3]["id"] == "fco_mine"
    assert all(i["status"] == "completed" for i in items)
    assert input_items(ResponsesRequest.model_validate({"input": "hi"}))[0]["content"] == [
        {"type": "input_text", "text": "hi"}]
    ids = [i["id"] for i in items]
    page = items_page(items, None, 3, "desc")  # newest first, as OpenAI lists them by default
    assert [i["id"] for i in page["data"]] == ids[::-1][:3] and page["has_more"]
    assert page["first_id"] == ids[3] and page["last_id"] == ids[1]
    rest = items_page(items, page["last_id"], 3, "desc")
    assert [i["id"] for i in rest["data"]] == [ids[0]] and not rest["has_more"]
    assert [i["id"] for i in items_page(items, None, 20, "asc")["data"]] == ids
    assert items_page(items, ids[3], 5, "asc")["data"] == [] and items_page([], None, 5, "asc")["first_id"] is None
    with pytest.raises(APIError) as e:
        items_page(items, "msg_unknown", 5, "asc")
    assert e.value.status == 400 and e.value.param == "after"


def test_a_file_keeps_them_across_restarts_in_their_order_of_use(tmp_path):
    path = tmp_path / "sub" / "responses.db"
    store = ResponseStore(path=path)
    for name in "abcd":
        store.put(name, name.encode() * 3)
    assert store.get("a") == b"aaa"  # used last: now the most recent
    assert store.delete("c")
    store.put("b", b"B")  # replaced
    store.close()
    again = ResponseStore(max_responses=2, path=path)  # a smaller store: the least recently used go
    assert again.get("c") is None and again.get("d") is None
    assert again.get("a") == b"aaa" and again.get("b") == b"B"
    assert again.snapshot() == {"responses": 2, "bytes": 4}
    again.close()
    third = ResponseStore(path=path)  # what the smaller store dropped is gone from the file too
    assert len(third) == 2 and third.get("d") is None
    third.put("e", b"e")
    third.close()
    assert ResponseStore(path=path).get("e") == b"e"


def test_an_unusable_file_is_a_clear_error(tmp_path):
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(RuntimeError, match="cannot use .*dir.db as the stored responses' file"):
        ResponseStore(path=tmp_path / "dir.db")


def test_the_engine_process_keeps_them_in_its_file(tiny_llama_dir, tmp_path):
    """`serve --response-store FILE`: the engine process's store (every front-end's) outlives it."""
    from constrained_spec.engine import EngineConfig
    from constrained_spec.server.engine_process import EngineProcess
    path = tmp_path / "responses.db"
    config = EngineConfig(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_slots=512)
    for step in ("put", "get"):
        process = EngineProcess(config, response_store=str(path))
        client = process.connect(owns_process=True)
        try:
            if step == "put":
                client.responses_async("put", "resp_1", b'[{"id": "resp_1"}]').result(30)
            else:
                assert client.responses_async("get", "resp_1").result(30) == b'[{"id": "resp_1"}]'
        finally:
            client.shutdown()
