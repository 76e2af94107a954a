"""Lifecycles of the split server (engine process + front-ends), on a tiny random model:
a front-end that goes away loses no other front-end's request and frees its KV; a request the
engine refuses fails alone; the engine process dying turns /health unhealthy and answers 503
instead of hanging clients, and a supervised one is started again and reconnected to; shutdown
stops the engine process. (A client disconnect aborting its
request is tested against the SmolLM2 split server in test_server_concurrency.py.)"""
from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from constrained_spec.engine import EngineConfig
from constrained_spec.server.app import ServerConfig, create_app
from constrained_spec.server.engine_process import EngineProcess
from constrained_spec.server.runner import start_server_thread

MODEL = "tiny"


def _config(model_dir: str, **kw) -> EngineConfig:
    kw.setdefault("max_running_requests", 8)
    return EngineConfig(model=model_dir, device="cpu", dtype="float32", grammar_cache_dir="none", **kw)


def _front_end(process: EngineProcess, owns: bool = False):
    client = process.connect(owns_process=owns)
    handle = start_server_thread(create_app(client, ServerConfig(served_model_name=MODEL), owns_engine=owns))
    return client, handle


def _body(max_tokens: int, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Talk."}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, **kw}


def _health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=30)


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _idle(url: str) -> bool:
    h = _health(url).json()
    return h["kv_free_slots"] == h["kv_capacity"] and not h["requests_running"] and not h["requests_waiting"]


class _Stream(threading.Thread):
    """A streamed request read to its end in a thread: its events, its end, or the error raised."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[dict] = []
        self.first = threading.Event()
        self.error: Exception | None = None
        self.done_marker = False
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json={**self.body, "stream": True},
                              timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done_marker = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        if len(self.events) >= 3:
                            self.first.set()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.first.set()


def _stream_then_post(stream_url: str, post_url: str, post_tokens: int):
    """A long streamed request (480 tokens) once its first tokens are out, then a request of
    `post_tokens` in a thread: (the stream, the thread, the dict its response lands in as "r")."""
    stream = _Stream(stream_url, _body(480))
    stream.first.wait(60)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "r", httpx.post(post_url + "/v1/chat/completions", json=_body(post_tokens), timeout=120)))
    t.start()
    return stream, t, result


@pytest.fixture(scope="module")
def shared_process(tiny_llama_dir):
    """One engine process for two front-ends."""
    process = EngineProcess(_config(tiny_llama_dir, max_queued_requests=2))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def full_process(tiny_llama_dir):
    """An engine process that takes 2 requests at once and queues none (the refusal test)."""
    process = EngineProcess(_config(tiny_llama_dir, max_running_requests=2, max_queued_requests=0))
    yield process
    process.stop()


def test_front_end_restart_loses_no_other_request(shared_process):
    client_a, server_a = _front_end(shared_process)
    client_b, server_b = _front_end(shared_process)
    try:
        for _attempt in range(3):  # on a loaded host A's 480 tokens may all be out before B's request runs
            doomed, t, result = _stream_then_post(server_a.url, server_b.url, 48)
            _wait(lambda: _health(server_b.url).json()["requests_running"] == 2 or not doomed.is_alive(), 30,
                  "both requests running, or A's over")
            if doomed.is_alive():
                break
            t.join(120)
            _wait(lambda: _idle(server_b.url), 15, "idle before another try")
        else:
            pytest.fail("A's request ended before B's ran, three times")
        client_a.shutdown()  # front-end A is gone (its process died or restarts): its connection closes
        t.join(120)
        r = result["r"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 48
        _wait(lambda: _idle(server_b.url), 15, "A's request not aborted: its KV is still held")
        doomed.join(30)
        assert doomed.events[-1]["error"]["code"] == "engine_unavailable"  # A's own stream ends in an error
        # a new front-end takes A's place
        client_a2, server_a2 = _front_end(shared_process)
        try:
            r = httpx.post(server_a2.url + "/v1/chat/completions", json=_body(8), timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        finally:
            server_a2.stop()
            client_a2.shutdown()
    finally:
        server_a.stop()
        server_b.stop()
        client_b.shutdown()


def test_a_late_answer_to_a_call_given_up_on_fails_nothing(shared_process, monkeypatch):
    """A /health whose engine snapshot outlasted its timeout (the engine process stalled): the late
    reply was set on the cancelled future, which raised in the reader thread, and every request in
    flight failed as if the engine had died (QA 1130b soak D3)."""
    from constrained_spec.server import service
    monkeypatch.setattr(service, "ENGINE_CALL_TIMEOUT_S", 0.5)
    client, server = _front_end(shared_process)
    try:
        stream = _Stream(server.url, _body(200))
        stream.first.wait(60)
        os.kill(shared_process.info.pid, signal.SIGSTOP)
        try:
            assert _health(server.url).status_code == 503  # timed out: the engine does not answer
        finally:
            os.kill(shared_process.info.pid, signal.SIGCONT)
        stream.join(120)
        assert stream.error is None and stream.done_marker, stream.error
        assert stream.events[-1]["choices"][0]["finish_reason"] == "length"
        assert client.healthy and _health(server.url).status_code == 200
    finally:
        server.stop()
        client.shutdown()


def test_a_whole_answer_crosses_in_two_updates(shared_process):
    """A non-streamed request without stop strings: the engine process sends its first update and
    its last (with every token since), not one a step; its answer is the streamed one, logprobs too.
    The streamed one's tokens between its first and its last come as small step-token entries."""
    from constrained_spec.sampling_params import SamplingParams
    client = shared_process.connect()
    updates: list[list[tuple]] = []
    step_tokens: list[tuple] = []
    on_updates = client._on_updates
    client._on_updates = lambda tokens, batch: (updates.append(batch), step_tokens.extend(tokens),
                                                on_updates(tokens, batch))
    try:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
        outs = {}
        for stream in (False, True):
            got, done = [], threading.Event()
            client.add_request([1, 5, 9, 13], params, None, lambda out, got=got, done=done: (
                got.append(out), out.finished and done.set()), request_id=f"r-{stream}", stream=stream)
            assert done.wait(60)
            outs[stream] = got
        whole, streamed = outs[False], outs[True]
        assert len(whole) == 1 and len(streamed) == 24
        assert whole[0].new_token_ids == [t for o in streamed for t in o.new_token_ids]
        assert whole[0].new_text == "".join(o.new_text for o in streamed)
        expected = [lp for o in streamed for lp in o.logprobs]  # two runs: sums may differ in the last bits
        assert len(whole[0].logprobs) == 24
        for got_lp, want in zip(whole[0].logprobs, expected):
            assert got_lp["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
            assert [t for t, _ in got_lp["top"]] == [t for t, _ in want["top"]]
        assert whole[0].completion_tokens == 24
        keys = [[u[0] for u in batch] for batch in updates]
        first_key = keys[0][0]
        assert sum(k.count(first_key) for k in keys) == 2  # the first token, and the rest at the end
        second_key = next(k for batch in keys for k in batch if k != first_key)
        assert sum(k.count(second_key) for k in keys) == 2  # streamed: its first token and its last...
        mine = [t for t in step_tokens if t[0] == second_key]  # ...and the 22 between as step tokens
        assert [t[1] for t in mine] == [o.new_token_ids[0] for o in streamed[1:-1]]
        assert [t[3] for t in mine] == list(range(2, 24)) and all(t[2] is not None for t in mine)
        assert not [t for t in step_tokens if t[0] == first_key]
    finally:
        client.shutdown()


def test_an_aborted_request_reaches_the_metrics(shared_process):
    """A request its client gave up on (a disconnect): the front-end forgets it, so the engine's
    ABORT end never reaches it; the /metrics listeners still see it end, as "abort"."""
    from constrained_spec.engine.request import FinishReason
    from constrained_spec.sampling_params import SamplingParams
    client = shared_process.connect()
    ends, started = [], threading.Event()
    client.stats.listeners.append(lambda event, p: event == "finish" and ends.append(p))
    try:
        client.add_request([1, 5, 9, 13], SamplingParams(max_tokens=400, ignore_eos=True), None,
                           lambda out: started.set(), request_id="gone")
        assert started.wait(60)
        client.abort("gone")
        assert [(p.request_id, p.finish_reason) for p in ends] == [("gone", FinishReason.ABORT)]
        assert ends[0].output_ids and ends[0].prompt_ids == [1, 5, 9, 13]
        _wait(lambda: not client._by_id, 5, "forgotten")
        time.sleep(0.5)
        assert len(ends) == 1  # the engine's own end of it does not count it twice
    finally:
        client.shutdown()


def test_a_request_the_engine_refuses_fails_alone(full_process):
    """Two front-ends share the engine's room for 2 (running + queued): A fills it, B's request is
    refused by the engine itself, a 503 with Retry-After as a full single-process server answers;
    that request alone fails, A's finish, and B keeps serving."""
    client_a, server_a = _front_end(full_process)
    client_b, server_b = _front_end(full_process)
    try:
        # long enough that both are still running when B asks, on a loaded CI machine too (64 tokens
        # sometimes finished first under the full suite)
        streams = [_Stream(server_a.url, _body(400)) for _ in range(2)]
        for s in streams:
            s.first.wait(60)
        r = httpx.post(server_b.url + "/v1/chat/completions", json=_body(8), timeout=60)
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text  # as the single-process server
        assert r.json()["error"]["code"] == "server_busy" and "queue is full" in r.json()["error"]["message"]
        for s in streams:
            s.join(120)
            assert s.error is None and s.done_marker, s.error
            assert s.events[-1]["choices"][0]["finish_reason"] == "length"
        _wait(lambda: _idle(server_b.url), 15, "KV not free")
        r = httpx.post(server_b.url + "/v1/chat/completions", json=_body(4), timeout=60)
        assert r.status_code == 200, r.text
    finally:
        for s, c in ((server_a, client_a), (server_b, client_b)):
            s.stop()
            c.shutdown()


def test_engine_process_death_is_reported(tiny_llama_dir):
    process = EngineProcess(_config(tiny_llama_dir))
    client, server = _front_end(process, owns=True)
    try:
        stream, t, result = _stream_then_post(server.url, server.url, 480)
        _wait(lambda: _health(server.url).json().get("requests_running") == 2, 30, "both requests running")
        t0 = time.monotonic()
        os.kill(process.info.pid, signal.SIGKILL)
        t.join(30)
        stream.join(30)
        assert time.monotonic() - t0 < 10, "clients were left hanging"
        r = result["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        assert stream.error is None, stream.error
        assert stream.events[-1]["error"]["code"] == "engine_unavailable", stream.events[-1]
        h = _health(server.url)
        assert h.status_code == 503 and h.json()["status"] == "unhealthy"
        r = httpx.post(server.url + "/v1/chat/completions", json=_body(4), timeout=30)
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 200  # the front-end still answers
    finally:
        server.stop()
        client.shutdown()


def test_a_dead_engine_process_is_started_again(tiny_llama_dir, caplog):
    """Supervised (as `serve` runs it), an engine process that dies fails its requests in flight,
    is started again at the same address, and every front-end reconnects and serves; one that dies
    while it starts again is one more death, and started again (QA: the supervisor gave up at the
    first failed start, the server down for good with restarts unused); past `max_restarts` deaths
    within the window it stays down and /health says so. Each front-end takes the new engine's
    limits (`info`)."""
    process = EngineProcess(_config(tiny_llama_dir))
    process.supervise(max_restarts=2)
    client, server = _front_end(process, owns=True)
    other, other_server = _front_end(process)
    try:
        first = process.info.pid
        assert process.info.start_s > 0
        t0 = time.monotonic()
        os.kill(first, signal.SIGKILL)
        _wait(lambda: _health(server.url).status_code == 503, 10, "the death seen")
        # retry once it may be back: after as long as its start took (QA: Retry-After 1 for a ~15 s restart)
        r = httpx.post(server.url + "/v1/chat/completions", json=_body(4), timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        assert r.headers["retry-after"] == str(max(1, math.ceil(process.info.start_s))), r.headers
        _wait(lambda: process.process.pid != first, 10, "a start again")
        os.kill(process.process.pid, signal.SIGKILL)  # while it loads (its model takes seconds)
        for url in (server.url, other_server.url):
            _wait(lambda: _health(url).status_code == 200, 120, "the engine back")
            r = httpx.post(url + "/v1/chat/completions", json=_body(4), timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert process.restarts == 1 and process.info.pid != first
        for c in (client, other):  # each front-end asked the new engine for its limits
            assert c.info.pid == process.info.pid and c.info.kv_capacity == process.info.kv_capacity
            assert c.info.tokenizer is c.tokenizer
        print(f"engine back in {time.monotonic() - t0:.1f} s")
        os.kill(process.info.pid, signal.SIGKILL)  # the third death in the window: stays down
        _wait(lambda: _health(server.url).status_code == 503, 10, "the second death seen")
        time.sleep(3)
        assert process.restarts == 1 and not process.alive()
        assert _health(other_server.url).status_code == 503
        # given up: no Retry-After to promise (the SDKs' retries would meet the same 503), and why
        for url in (server.url, other_server.url):
            _wait(lambda: "restarted" in _health(url).json()["error"], 5, "the give-up seen")
            r = httpx.post(url + "/v1/chat/completions", json=_body(4), timeout=60)
            assert r.status_code == 503 and "retry-after" not in r.headers, (r.headers, r.text)
            assert "3 times within 600 s" in r.json()["error"]["message"], r.text
        deaths = [r.getMessage() for r in caplog.records
                  if r.name.endswith("engine_process") and "the engine process died" in r.getMessage()]
        assert len(deaths) == 3 and all("(signal 9)" in d for d in deaths[::2]), deaths  # reaped: not "exit code None"
    finally:
        other_server.stop()
        other.shutdown()
        server.stop()
        client.shutdown()


def test_shutdown_stops_the_engine_process(tiny_llama_dir):
    process = EngineProcess(_config(tiny_llama_dir))
    client, server = _front_end(process, owns=True)
    stream = _Stream(server.url, _body(480))
    stream.first.wait(60)
    t0 = time.monotonic()
    server.stop(timeout=30)  # uvicorn drains for up to 5 s, then cancels; the app's shutdown stops the engine
    _wait(lambda: not process.alive(), 30, "the engine process outlived the server")
    stream.join(30)
    assert not stream.is_alive(), "the client was left hanging"
    assert time.monotonic() - t0 < 30
    assert client.closed and not client.healthy


def _exited(pid: int) -> bool:
    """Every thread of the process has exited, so its file descriptors are closed. The leader shows
    "Z" as soon as it exits, while other threads, sharing its descriptor table, may still be on
    their way out holding its listening socket (which then takes new connections, and resets them):
    so every task must be a zombie, or gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return True
    for task in tasks:
        try:
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return False
        except (FileNotFoundError, ProcessLookupError):
            pass  # that thread was released meanwhile
    return True


def test_front_end_sockets_share_new_connections():
    """Each front-end's socket on the port gets its share of new connections (SO_REUSEPORT), not
    whichever process accepts first: 64 connections over two sockets, at least 16 each (a fair
    coin gives fewer about once in 25,000 runs)."""
    import socket

    from constrained_spec.server.frontends import BALANCED, bind_socket
    if not BALANCED:
        pytest.skip("balanced front-end sockets are Linux's (SO_REUSEPORT); elsewhere they share one")
    first = bind_socket("127.0.0.1", 0)
    second = bind_socket("127.0.0.1", first.getsockname()[1], join=True)
    idle = socket.create_connection(first.getsockname())  # a joining socket takes none before it listens
    first.settimeout(2.0)
    first.accept()[0].close()
    idle.close()
    second.listen(64)  # (uvicorn's, once it serves)
    with pytest.raises(OSError):  # a second server on the port is an error, not a share of it
        bind_socket("127.0.0.1", first.getsockname()[1])
    clients = [socket.create_connection(first.getsockname()) for _ in range(64)]
    accepted = []
    for sock in (first, second):
        sock.settimeout(0.5)
        n = 0
        try:
            while True:
                sock.accept()[0].close()
                n += 1
        except TimeoutError:
            pass
        accepted.append(n)
        sock.close()
    for c in clients:
        c.close()
    assert sum(accepted) == 64 and min(accepted) >= 16, accepted


def test_serve_with_two_front_ends(tiny_llama_dir, tmp_path):
    """`serve --frontends 2`: both front-end processes answer on one port, /metrics counts every
    front-end's requests, a front-end killed is started again while the other serves on, and
    SIGTERM stops everything (no process left behind)."""
    import re
    import subprocess
    import sys

    from constrained_spec.server.runner import free_port

    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log_file:
        serve = subprocess.Popen([sys.executable, "-m", "constrained_spec.cli", "serve", "--model", tiny_llama_dir,
                                  "--device", "cpu", "--dtype", "float32", "--grammar-cache-dir", "none",
                                  "--served-model-name", MODEL, "--port", str(port), "--frontends", "2"],
                                 stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert serve.poll() is None, log_path.read_text()
            try:
                return _health(url).status_code == 200
            except httpx.HTTPError:
                return False
        _wait(up, 180, "serve did not come up")
        log = log_path.read_text()
        engine_pid = int(re.search(r"engine ready in process (\d+)", log).group(1))
        other_pid = int(re.search(r"front-end processes share the port \(this one and pids (\d+)\)", log).group(1))

        def at_once(n: int, send) -> list:
            """The status codes of n requests at once, each on a connection of its own (to whichever
            front-end accepts it), or the name of the error that ended it."""
            codes: list = []

            def one():
                try:
                    codes.append(send().status_code)
                except httpx.HTTPError as e:
                    codes.append(type(e).__name__)
            threads = [threading.Thread(target=one) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            return codes

        ask = lambda n: at_once(n, lambda: httpx.post(url + "/v1/chat/completions", json=_body(4), timeout=60))
        # a front-end takes connections only once it serves, so none waits on one that is still starting
        answered = lambda n: at_once(n, lambda: httpx.get(url + "/v1/models", timeout=3))

        assert answered(16) == [200] * 16  # front-end 0 serves at once; front-end 1 joins once it serves
        from constrained_spec.server.runner import wait_for_frontends
        assert wait_for_frontends(url, 120) == 2  # /health on fresh connections: "frontend" 0 and 1 of "frontends" 2
        assert answered(16) == [200] * 16
        assert ask(8) == [200] * 8
        metrics = httpx.get(url + "/metrics", timeout=30).text
        served = re.search(r'http_requests_total\{endpoint="/v1/chat/completions",status="200"\} (\S+)', metrics)
        assert served and float(served.group(1)) == 8.0, metrics[:2000]

        os.kill(other_pid, signal.SIGKILL)
        # Once it is gone (its sockets closed), every new connection goes to the other front-end.
        # Connections the kernel gave the dying one's own socket before that are reset with it
        # (SO_REUSEPORT; `net.ipv4.tcp_migrate_req=1` hands them to the others instead).
        _wait(lambda: _exited(other_pid), 30, "the killed front-end did not exit")
        restarted_by = time.monotonic() + 90
        assert ask(4) == [200] * 4  # the other front-end serves on
        _wait(lambda: "starting it again" in log_path.read_text(), 30, "the killed front-end was not restarted")
        while len(re.findall(r"front-end 1 serving", log_path.read_text())) < 2:  # while it starts again
            assert answered(8) == [200] * 8
            assert time.monotonic() < restarted_by, "the killed front-end was not started again"
        assert ask(4) == [200] * 4
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            code = serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
            raise
    assert code == 0, log_path.read_text()[-3000:]

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
    _wait(lambda: gone(engine_pid), 30, "the engine process outlived serve")
    restarted = re.findall(r"front-end 1 serving \(pid (\d+)\)", log_path.read_text())
    _wait(lambda: all(gone(int(p)) for p in restarted), 30, "a front-end outlived serve")
