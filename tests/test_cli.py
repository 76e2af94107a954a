"""The `constrained-spec` command: --help reads well, flags map onto EngineConfig, `generate --schema`
prints valid JSON, and `serve` (what `make serve` runs) serves: a curl json_schema request returns JSON
that validates, and the startup log names the model, device, KV capacity and URL."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from constrained_spec.cli import build_parser, engine_config_from_args
from server_fixtures import *  # noqa: F401,F403

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "constrained_spec.cli"]
SCHEMA = {"type": "object", "properties": {"animal": {"type": "string", "enum": ["cat", "dog", "owl"]},
                                           "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
          "required": ["animal", "legs"], "additionalProperties": False}


def run_cli(*args, timeout=120, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)


def test_help_reads_well():
    top = run_cli("--help")
    assert top.returncode == 0
    assert "serve" in top.stdout and "generate" in top.stdout
    serve = run_cli("serve", "--help")
    assert serve.returncode == 0
    for flag in ("--model", "--host", "--port", "--api-key", "--device", "--dtype", "--attention-backend",
                 "--kv-cache-memory-gb", "--max-running-requests", "--log-level", "examples:"):
        assert flag in serve.stdout, flag
    assert "127.0.0.1" in serve.stdout  # the default bind address is stated
    gen = run_cli("generate", "--help")
    assert gen.returncode == 0 and "--schema" in gen.stdout and "--choice" in gen.stdout
    assert run_cli().returncode == 2  # no command: help, non-zero


def test_flags_map_to_engine_config():
    args = build_parser().parse_args(["serve", "--model", "/m", "--device", "cpu", "--dtype", "float32",
                                      "--attention-backend", "torch", "--memory-budget", "0.5",
                                      "--max-running-requests", "7", "--max-queued-requests", "9",
                                      "--disable-overlap", "--port", "9001"])
    cfg = engine_config_from_args(args)
    assert (cfg.model, cfg.device, cfg.dtype, cfg.attention_backend) == ("/m", "cpu", "float32", "torch")
    assert cfg.kv_cache_memory_gb == 0.5 and cfg.max_running_requests == 7 and cfg.max_queued_requests == 9
    assert cfg.disable_overlap is True and args.port == 9001 and args.host == "127.0.0.1"
    defaults = engine_config_from_args(build_parser().parse_args(["serve"]))
    from constrained_spec.engine import EngineConfig
    assert defaults == EngineConfig()


@pytest.mark.slow
@pytest.mark.parametrize("argv, says", [
    (["serve", "--port", "-1"], "--port must be at least 0"),
    (["serve", "--port", "70000"], "--port must be at most 65535"),
    (["serve", "--max-running-requests", "0"], "--max-running-requests must be at least 1"),
    (["serve", "--frontends", "0"], "--frontends must be at least 1"),
    (["serve", "--max-body-mb", "-3"], "--max-body-mb must be positive"),
    (["serve", "--model", "/nonexistent/x.gguf"], "neither an existing path nor a known alias"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["generate", "hi", "--device", "tpu"], "--device must be cpu, cuda, cuda:N or auto"),
    (["serve", "--max-model-len", "-5"], "--max-model-len must be at least 1"),
    (["serve", "--speculative-num-draft-tokens", "0"], "--speculative-num-draft-tokens must be at least 1"),
    (["serve", "--grammar-threads", "-2"], "--grammar-threads must be at least 1"),
    (["generate", "hi", "--temperature", "-1"], "--temperature must be at least 0.0"),
    (["generate", "hi", "--top-p", "5"], "--top-p must be at most 1.0"),
])
def test_bad_flags_exit_2_with_one_line(argv, says, capsys):
    """Checked before anything loads: these used to start a server that never admitted a request,
    fail late in uvicorn, or end in a traceback."""
    from constrained_spec.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("extra, says", [
    (["--schema", "{array}"], "JSON schema must be a JSON object or boolean"),
    (["--schema", "{loop}"], "leads only to references back to itself"),
    (["--ebnf", "{empty}"], "EBNF grammar must be a non-empty string"),
    (["--choice", ""], "choice must be a non-empty list"),
    (["--regex", ""], "regex must be a non-empty string"),  # (it ran unconstrained)
    (["--system", "Be brief", "--raw"], "--system needs the chat template"),  # (dropped without a word)
    (["--request-seed", str(2**70)], "--request-seed must be a 64-bit"),  # (named --seed's parameter)
    (["--model", ""], "--model is empty"),  # (loaded the default model)
    (["--attention-backend", "triton", "--device", "cpu"], "needs a CUDA device"),  # (after the load, a traceback)
])
def test_bad_generate_inputs_exit_2_with_one_line(extra, says, tmp_path, capsys):
    """QA 1130 engine D5, D7, D9: checked before the model loads."""
    from constrained_spec.cli import main
    files = {"array": "[1, 2]", "loop": '{"$ref": "#"}', "empty": ""}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = ["generate", "hi", *[a.format(**{k: str(tmp_path / k) for k in files}) for a in extra]]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_generate_a_prompt_past_the_context_is_one_line(tiny_llama_dir):
    """QA 1130 engine D6: a RequestError traceback, exit 1."""
    r = run_cli("generate", "word " * 300, "--max-model-len", "64", "--model", tiny_llama_dir, "--device", "cpu")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("constrained-spec: the prompt has"), \
        r.stderr[-2000:]


def test_a_cuda_device_without_cuda_is_one_line(capsys, monkeypatch):
    import torch
    from constrained_spec.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--device", "cuda"])
    assert e.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


def test_a_taken_port_is_one_line_before_the_model_loads(capsys, tiny_llama_dir):
    """It was found by uvicorn after the model had loaded, under a log line that said it served."""
    import socket
    from constrained_spec.cli import main
    with socket.create_server(("127.0.0.1", 0)) as taken:
        code = main(["serve", "--port", str(taken.getsockname()[1]), "--model", tiny_llama_dir, "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot listen on 127.0.0.1 port" in err and len(err.strip().splitlines()) == 1, err


def test_generate_json_cut_by_max_tokens_exits_3(server_model_path):
    """As with --schema (docs/cli.md: exit 3, JSON cut off by --max-tokens); --json exited 0."""
    r = run_cli("generate", "Describe a cat as JSON.", "--json", "--max-tokens", "4", "--model", server_model_path,
                "--device", "cpu")
    assert r.returncode == 3 and "before the JSON was complete" in r.stderr, (r.stdout, r.stderr[-2000:])


def test_generate_with_schema(tmp_path, server_model_path):
    schema_file = tmp_path / "animal.json"
    schema_file.write_text(json.dumps(SCHEMA))
    r = run_cli("generate", "Describe an animal as JSON.", "--schema", str(schema_file), "--model",
                server_model_path, "--device", "cpu", "--max-tokens", "64")
    assert r.returncode == 0, r.stderr[-2000:]
    jsonschema.validate(json.loads(r.stdout), SCHEMA)
    r = run_cli("generate", "Is water wet?", "--choice", "yes", "no", "--model", server_model_path, "--device", "cpu")
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no"), r.stderr[-2000:]


@pytest.mark.slow
def test_serve_and_curl(server_model_path):
    from constrained_spec.server.runner import free_port
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--model", server_model_path, "--device", "cpu", "--port", str(port),
                             "--served-model-name", "smollm2"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        body = json.dumps({"model": "smollm2", "max_tokens": 64, "temperature": 0,
                           "messages": [{"role": "user", "content": "Describe an animal as JSON."}],
                           "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "animal", "schema": SCHEMA}}})
        if shutil.which("curl"):
            out = subprocess.run(["curl", "-sS", url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                                  "-d", body], capture_output=True, text=True, timeout=60).stdout
        else:
            out = httpx.post(url + "/v1/chat/completions", content=body,
                             headers={"Content-Type": "application/json"}, timeout=60).text
        resp = json.loads(out)
        jsonschema.validate(json.loads(resp["choices"][0]["message"]["content"]), SCHEMA)
    finally:
        proc.terminate()
        try:
            log, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
    for needle in ("model ", "device cpu", "KV capacity", f"http://127.0.0.1:{port}/v1"):
        assert needle in log, (needle, log[-3000:])
    assert proc.returncode in (0, -15), log[-3000:]


def test_mask_threads_leave_the_front_ends_their_cores(monkeypatch):
    import constrained_spec.cpus as cpus
    from constrained_spec.engine.config import default_mask_threads
    monkeypatch.setattr(cpus, "available_cores", lambda: 16)
    assert (default_mask_threads(), default_mask_threads(reserved=4)) == (14, 10)
    monkeypatch.setattr(cpus, "available_cores", lambda: 2)
    assert default_mask_threads(reserved=1) == 1
    monkeypatch.setattr(cpus, "available_cores", lambda: 64)
    assert default_mask_threads() == 16


@pytest.mark.parametrize("layout", [["--single-process"], []])
def test_serve_refuses_an_unusable_response_store(tiny_llama_dir, tmp_path, layout):
    """`serve --response-store` naming a folder: exit 1 with the reason, single-process or split."""
    (tmp_path / "a-folder").mkdir()
    r = run_cli("serve", "--model", tiny_llama_dir, "--device", "cpu", "--port", "0", "--frontends", "1", *layout,
                "--response-store", str(tmp_path / "a-folder"), timeout=180)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "cannot use" in r.stderr and "stored responses' file" in r.stderr, r.stderr[-2000:]
    if layout:  # the serve process's own error: a line, not a traceback
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
