"""benchmarks/stress_schemas.py as tests: its answer classification, a CPU form at 8 clients against the real
server (SmolLM2 on the CPU, started as a subprocess), and a short GPU form (64 clients, ~100 schemas).

Every answer must be valid, refused for a keyword, or truncated: never invalid, an error, or a refusal for load.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from sizes import FULL

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "stress_schemas.py"
_spec = importlib.util.spec_from_file_location("stress_schemas", _PATH)
stress = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = stress  # dataclasses look their module up
_spec.loader.exec_module(stress)

CPU_DEV_SCHEMAS = 8  # plus the conformance cases: 32 schemas
CPU_MAX_TOKENS = 64


def cpu_cases(half: int) -> list:
    """The CPU runs' schemas: all 32 each, or at the quick size one half each (`half` 0 or 1)."""
    cases = stress.load_cases(limit=CPU_DEV_SCHEMAS)
    return cases if FULL else cases[half::2]


def _assert_clean(summary: dict) -> None:
    report = stress.format_report([summary])
    print("\n" + report)
    assert summary["requests"] == sum(summary["tally"].values())
    for outcome in stress.FAILING:
        assert summary["tally"][outcome] == 0, report
    assert not summary["end_violations"], report


def test_classifies_answers():
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"],
              "additionalProperties": False}

    def completion(content, finish):
        return stress.classify_completion(stress.Answer("x", "bounded", "object"), schema, content, finish)

    assert completion('{"a": "abc"}', "stop").outcome == "valid"
    bad = completion('{"a": "abcd"}', "stop")
    assert bad.outcome == "invalid" and "too long" in bad.detail and bad.content == '{"a": "abcd"}'
    assert completion('{"a": "abc"}\n```', "stop").outcome == "invalid"
    cut = completion('{"a": "ab', "length")
    assert cut.outcome == "truncated" and cut.open_string_chars == 2 and not cut.looping
    assert completion('{"a": ["the-source","the-source","the-source","the-source","the-', "length").looping
    assert completion('{"a": "abc"}', "error").outcome == "error"

    unsupported = {"error": {"message": "invalid JSON schema: unsupported JSON Schema keyword 'dependentSchemas' "
                                        "at the schema root", "code": "unsupported_schema"}}
    assert stress.classify_refusal(400, unsupported)[:2] == ("refused", "dependentSchemas")
    assert stress.classify_refusal(400, {"error": {"message": "compile exceeded 30s: this grammar is too large or complex to compile in time"}})[0] \
        == "refused_load"
    assert stress.classify_refusal(503, {"error": {"message": "the server is at its limit"}})[0] == "refused_load"
    assert stress.classify_refusal(500, {"error": {"message": "generation failed"}})[0] == "error"


def test_validates_formats_and_kinds():
    assert stress.validation_error({"format": "json-pointer"}, '"/a/b~1c"') is None
    assert stress.validation_error({"format": "json-pointer"}, '"a/b"') is not None
    assert stress.validation_error({"format": "relative-json-pointer"}, '"1/a"') is None
    assert stress.validation_error({"format": "date-time"}, '"2024-02-29T10:00:00Z"') is None
    assert stress.validation_error({"format": "date-time"}, '"2023-02-29T10:00:00Z"') is not None
    assert stress.validation_error({"format": "uri"}, '"//thelist/x"') is not None
    assert stress.validation_error({"type": "string", "pattern": "^/"}, '"//ok"') is None
    assert stress.schema_kind({}) == "free-form"
    assert stress.schema_kind({"patternProperties": {"f.*o": {"type": "integer"}}}) == "free-form"
    assert stress.schema_kind({"type": "object", "properties": {"s": {"type": "string"}}}) == "unbounded-string"
    assert stress.schema_kind({"type": "array", "items": {"type": "integer"}}) == "unbounded-array"
    assert stress.schema_kind({"type": "array", "items": {"enum": ["a"]}, "maxItems": 2}) == "bounded"
    cases = stress.load_cases(limit=3)
    assert len(cases) > 3 and all(c.kind in stress.KINDS for c in cases)


def test_config_names():
    c = stress.parse_config("eagle-always-t0.7-stream-c16-fp0.5", clients=8, temperature=0.0, stream=False,
                            extra_args=["--device", "cpu"])
    assert c.server_args == ["--device", "cpu", "--speculative-algorithm", "eagle", "--speculative-policy", "always"]
    assert (c.clients, c.temperature, c.stream, c.sampling) == (16, 0.7, True, {"frequency_penalty": 0.5})
    assert stress.parse_config("ngram-greedy", 8, 0.7, True, []).server_args == ["--speculative-algorithm", "ngram"]
    assert stress.parse_config("eagle-chain", 8, 0.7, True, []).server_args == [
        "--speculative-algorithm", "eagle", "--eagle-topk", "1", "--eagle-depth", "7"]
    with pytest.raises(ValueError, match="unknown configuration part 'medusa'"):
        stress.parse_config("medusa-greedy", 8, 0.0, False, [])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t0.7-stream"])  # greedy, not streamed: test_stress_cpu_ngram
def test_stress_cpu(name, tmp_path):
    """Dev and conformance schemas, 8 clients, plain decoding on the CPU."""
    cases = cpu_cases(0)
    config = stress.parse_config(name, clients=8, temperature=0.0, stream=False, extra_args=["--device", "cpu"])
    summary, _ = stress.run_config(config, cases, CPU_MAX_TOKENS, seed=0, log_dir=tmp_path)
    _assert_clean(summary)


@pytest.mark.slow
def test_stress_cpu_ngram(tmp_path):
    """The same greedy and not streamed, with n-gram speculation (always on: the measured policy would
    run plain on the CPU)."""
    cases = cpu_cases(1)
    config = stress.parse_config("ngram-greedy", clients=8, temperature=0.0, stream=False,
                                 extra_args=["--device", "cpu", "--speculative-policy", "always"])
    summary, _ = stress.run_config(config, cases, CPU_MAX_TOKENS, seed=1, log_dir=tmp_path)
    _assert_clean(summary)


def test_tool_call_requests_and_answers():
    """`tools`: an object schema goes as a forced call's parameters (its arguments are the answer),
    another as response_format; a call of another function, or none, is an error."""
    obj, arr = (stress.Case("a/1", {"type": "object", "properties": {"x": {"type": "integer"}}}, "bounded", "object"),
                stress.Case("b", {"type": "array"}, "free-form", "array"))
    body = stress.request_body(obj, "m", 0.7, 32, False, 1, tools=True)
    assert body["tool_choice"] == {"type": "function", "function": {"name": "a_1"}} and "response_format" not in body
    assert body["tools"][0]["function"]["parameters"] == obj.schema
    assert "tools" not in stress.request_body(arr, "m", 0.7, 32, False, 1, tools=True)
    call = lambda name, args: {"content": None, "tool_calls": [{"function": {"name": name, "arguments": args}}]}
    assert stress._answer(call("a_1", '{"x": 1}'), "tool_calls", body) == ('{"x": 1}', "stop")
    assert stress._answer(call("a_1", '{"x": '), "length", body) == ('{"x": ', "length")
    assert stress._answer(call("other", "{}"), "tool_calls", body)[1] != "stop"
    assert stress._answer({"content": "{}"}, "stop", body)[1] != "stop"
    assert stress.parse_config("plain-tools-greedy", 8, 0.7, False, []).tools


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tools-t0.7-stream", "responses-tools-greedy"])
def test_stress_cpu_tools(name, tmp_path):
    """Object schemas as forced tool calls, streamed and sampled, then through the Responses API (the
    other schemas as response_format / text.format)."""
    cases = cpu_cases(0)
    config = stress.parse_config(name, clients=8, temperature=0.0, stream=False, extra_args=["--device", "cpu"])
    summary, _ = stress.run_config(config, cases, CPU_MAX_TOKENS, seed=2, log_dir=tmp_path)
    _assert_clean(summary)


def test_responses_requests_and_answers():
    """`responses`: the chat body becomes the same Responses request, and a Response object the chat
    message and finish reason it stands for."""
    obj = stress.Case("a/1", {"type": "object", "properties": {"x": {"type": "integer"}}}, "bounded", "object")
    body = stress.request_body(obj, "m", 0.7, 32, True, 1, tools=True)
    r = stress.responses_body(body)
    assert r["tools"] == [{"type": "function", "name": "a_1", "parameters": obj.schema, "strict": True}]
    assert r["tool_choice"] == {"type": "function", "name": "a_1"} and r["max_output_tokens"] == 32
    assert r["input"] == body["messages"] and r["stream"] and "stream_options" not in r
    plain = stress.responses_body(stress.request_body(obj, "m", 0.7, 32, False, 1))
    assert plain["text"]["format"]["schema"] == obj.schema and plain["text"]["format"]["type"] == "json_schema"
    call = {"status": "completed", "output": [{"type": "function_call", "name": "a_1", "arguments": '{"x": 1}'}]}
    assert stress._answer(*stress.response_answer(call), body) == ('{"x": 1}', "stop")
    text = {"status": "incomplete", "output": [{"type": "message", "content": [{"type": "output_text", "text": "{"}]}]}
    assert stress.response_answer(text) == ({"content": "{"}, "length")
    assert stress.response_answer({"status": "failed", "output": []})[1] == "status failed"
    assert stress.parse_config("responses-greedy", 8, 0.7, False, []).responses


@pytest.mark.gpu
@pytest.mark.parametrize("name,backend", [("plain-t0.7", "xgrammar"), ("plain-greedy-stream", "xgrammar"),
                                          ("ngram-t0.7-stream", "xgrammar"), ("ngram-greedy", "xgrammar"),
                                          ("plain-t0.7", "auto"), ("ngram-greedy-stream", "auto"),
                                          ("plain-tools-t0.7-stream", "auto"),
                                          ("plain-responses-tools-t0.7-stream", "auto"),
                                          ("eagle-always-greedy", "xgrammar"), ("eagle-t0.7-stream", "auto"),
                                          ("eagle-chain-always-greedy", "xgrammar"),
                                          ("eagle-chain-always-t0.7-stream", "auto")])
def test_stress_gpu(name, backend, tmp_path, smollm2_dir):
    """~100 schemas at 64 clients on CUDA, max_tokens 256: the short form of the GPU stress run, under
    the default grammar backend and under auto (llguidance first). The real model (skipped, with the
    reason, where it cannot be had: the GPU machine reaches no registry unless its weights are carried)."""
    cases = stress.load_cases(limit=100 - len(stress.load_cases(limit=0)))
    config = stress.parse_config(name, clients=64, temperature=0.0, stream=False,
                                 extra_args=["--device", "cuda", "--grammar-backend", backend,
                                             "--model", str(smollm2_dir)])
    summary, _ = stress.run_config(config, cases, 256, seed=0, log_dir=tmp_path)
    _assert_clean(summary)
