"""`serve`'s shutdown, as a terminal, `timeout`, `kill -- -PGID` or systemd (KillMode=control-group)
brings it about: the signal reaches every process of the group, the engine process and the other
front-ends too. They ignore it and the `serve` process stops them once its requests drained: the
requests in flight finish (the engine process had died of the signal: its streams got an
`engine_unavailable` error event, and the supervisor loaded the model again during the shutdown).
Requests still running at the drain's deadline end as the server's own errors (a JSON 503
`server_shutting_down`, or a stream's error event and [DONE]), not uvicorn's plain-text 500 and a
stream cut short. A child whose `serve` process is killed outright still stops.

Each test runs `serve` on a tiny random Llama in a process group of its own."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from constrained_spec.server.runner import free_port, wait_for_frontends

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "constrained_spec.cli"]
BAD_LOG = ("starting it again", "Traceback", "KeyboardInterrupt", "Exception in ASGI application", "CancelledError",
           "engine process died")


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory, smollm2_dir) -> str:
    """A random 2-layer Llama whose context holds 16k tokens: a request can outlast the drain."""
    from transformers import LlamaConfig
    from conftest import TINY, _save_tiny
    cfg = LlamaConfig(**{**TINY, "max_position_embeddings": 16384}, tie_word_embeddings=False)
    return _save_tiny(tmp_path_factory.mktemp("long_tiny"), cfg, smollm2_dir)


class Serve:
    """`serve` in a new session (its own process group, as a terminal's foreground job is)."""

    def __init__(self, model: str, frontends: int, log_path: Path, args: tuple = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([*CLI, "serve", "--model", model, "--device", "cpu", "--port", str(self.port),
                                      "--frontends", str(frontends), "--max-model-len", "16384", *args],
                                     cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not come up\n" + self.log()
            time.sleep(0.1)
        if frontends > 1:
            assert wait_for_frontends(self.url, timeout_s=60) == frontends
        self.children = _children_of(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text()

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"serve still running {timeout} s after the signal\n" + self.log()[-4000:])

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.children]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


@pytest.fixture
def serve(tmp_path):
    started: list[Serve] = []

    def start(model: str, frontends: int = 1, args: tuple = ()) -> Serve:
        s = Serve(model, frontends, tmp_path / f"serve{len(started)}.log", args)
        started.append(s)
        return s
    yield start
    for s in started:
        if s.proc.poll() is None:
            s.kill()


def _children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _running(pid: int) -> bool:
    """Alive and not a zombie (a child of a parent killed outright may wait for a reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _left_running(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while [pid for pid in pids if _running(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _running(pid)]


def _chat(max_tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": "Write a story."}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream}


def _stream(url: str, body: dict, events: list, started: threading.Event | None = None) -> None:
    """The stream's `data:` payloads into `events` (an exception's name last, if it broke)."""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            events.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    if started is not None:
                        started.set()
    except Exception as e:
        events.append(type(e).__name__)
    finally:
        if started is not None:
            started.set()


def _assert_clean(log: str) -> None:
    for bad in BAD_LOG:
        assert bad not in log, f"{bad!r} in the log:\n{log[-4000:]}"


def _tokens_per_s(url: str) -> float:
    t = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", json=_chat(64, False), timeout=60)
    assert r.status_code == 200, r.text
    return 64 / (time.monotonic() - t)


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_drains_the_stream_and_exits_cleanly(serve, long_tiny_dir):
    """SIGINT to the group (Ctrl-C): the stream in flight ends as it would have ([DONE], finish
    reason "length", every token), the server exits 0, and the log has no traceback and no restart."""
    s = serve(long_tiny_dir, frontends=2)
    rate = _tokens_per_s(s.url)
    max_tokens = int(min(2000, max(40, rate * 1.5)))  # ~1.5 s of decoding: well inside the 5 s drain
    events: list = []
    started = threading.Event()
    client = threading.Thread(target=_stream, args=(s.url, _chat(max_tokens, True), events, started))
    client.start()
    assert started.wait(30)
    s.signal_group(signal.SIGINT)
    client.join(30)
    code = s.wait(30)
    log = s.log()
    assert events[0] == 200 and events[-1] == "[DONE]", (events[-3:], log[-3000:])
    chunks = [e for e in events[1:-1] if isinstance(e, dict)]
    assert not any("error" in c for c in chunks), (chunks[-3:], log[-3000:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-3:]
    assert code == 0, log[-3000:]
    _assert_clean(log)
    assert not _left_running(s.children, 5), "children left behind"


@pytest.mark.slow
def test_requests_past_the_drain_deadline_end_as_the_servers_own_errors(serve, long_tiny_dir):
    """SIGTERM (to the `serve` process) with requests that outlast the 5 s drain: uvicorn cancelled
    them at its deadline, a plain-text 500 with an ASGI traceback in the log, a stream cut with no
    end. Now the non-streamed one answers a JSON 503 `server_shutting_down`, and the stream sends
    its choice's end ("error"), an error event of that code and [DONE]."""
    s = serve(long_tiny_dir)
    rate = _tokens_per_s(s.url)
    max_tokens = int(min(16000, rate * 30))  # ~30 s of decoding: past the drain's deadline
    events: list = []
    started = threading.Event()
    whole: list = []

    def post() -> None:
        try:
            whole.append(httpx.post(s.url + "/v1/chat/completions", json=_chat(max_tokens, False), timeout=60))
        except Exception as e:
            whole.append(e)
    clients = [threading.Thread(target=_stream, args=(s.url, _chat(max_tokens, True), events, started)),
               threading.Thread(target=post)]
    for c in clients:
        c.start()
    assert started.wait(30)
    time.sleep(0.3)  # (the non-streamed request in the engine too)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    for c in clients:
        c.join(30)
    code = s.wait(30)
    log = s.log()
    r = whole[0]
    assert isinstance(r, httpx.Response), (r, log[-3000:])
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert r.json()["error"]["code"] == "server_shutting_down", r.text
    assert events[0] == 200 and events[-1] == "[DONE]", (events[-3:], log[-3000:])
    error = events[-2]
    assert isinstance(error, dict) and error["error"]["code"] == "server_shutting_down", events[-4:]
    assert all(c.get("finish_reason") is None for e in events[1:-2] for c in e["choices"]), events[-4:]
    assert time.monotonic() - t0 < 15, "the drain took too long"
    assert code == 0, log[-3000:]
    _assert_clean(log)


@pytest.mark.slow
def test_children_stop_when_serve_is_killed_outright(serve, long_tiny_dir):
    """SIGKILL to the `serve` process alone: its children (the engine process, a front-end) see
    their pipe to it close and stop; none is left running."""
    s = serve(long_tiny_dir, frontends=2)
    assert len(s.children) >= 2, s.children  # the engine process, front-end 1 (and multiprocessing's tracker)
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    assert not _left_running(s.children, 20), "children left behind\n" + s.log()[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [(), ("--single-process",)], ids=["split", "single-process"])
def test_a_grammar_compile_in_flight_does_not_hold_the_exit(serve, long_tiny_dir, mode):
    """SIGTERM while xgrammar compiles a 40,000-string enum (tens of seconds, and no way to stop
    it): the engine process waited for the compile until `serve` killed it, 15 s on ("did not
    stop within 15 s; killing it"); in one process, for the compile's whole time. Its compile now
    ends with the process, which leaves by os._exit (a compile thread inside native code aborts an
    interpreter's teardown)."""
    s = serve(long_tiny_dir, args=mode)
    enum = {"type": "string", "enum": [f"item-{i:05d}-{i * 7919 % 100003}" for i in range(40000)]}
    body = {**_chat(8, False), "grammar_backend": "xgrammar",
            "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": enum}}}
    answers: list = []

    def post() -> None:
        try:
            answers.append(httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60))
        except Exception as e:
            answers.append(e)
    client = threading.Thread(target=post)
    client.start()
    time.sleep(2)  # (its compile under way in the engine process)
    assert not answers, answers
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    client.join(30)
    code = s.wait(30)
    took, log = time.monotonic() - t0, s.log()
    r = answers[0]
    assert isinstance(r, httpx.Response) and r.status_code == 503, (r, log[-3000:])
    assert r.json()["error"]["code"] == "server_shutting_down", r.text
    assert took < 8, f"the exit took {took:.1f} s\n" + log[-3000:]
    assert code == 0 and "did not stop" not in log, log[-3000:]
    _assert_clean(log)
    assert not _left_running(s.children, 5), "children left behind"
