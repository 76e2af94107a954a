"""The `constrained-spec` command: `serve` an OpenAI-compatible API, or `generate` from the shell.

    constrained-spec serve [--model PATH] [--port 8000] [--api-key KEY] ...
    constrained-spec generate "Name three colors" --schema colors.json

Engine flags map one to one onto `EngineConfig` fields (`--max-running-requests` sets
`max_running_requests`); fields added to EngineConfig later get a flag automatically.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from .log_setup import setup_logging

log = logging.getLogger("constrained_spec.cli")

API_KEY_ENV = "CONSTRAINED_SPEC_API_KEY"
DEFAULT_MODEL_LABEL = "SmolLM2-135M-Instruct"

_DESCRIPTION = """\
constrained-spec: structured-output LLM serving. Every token follows the request's grammar
(JSON schema, regex, EBNF or a choice list); speculative decoding makes it fast.

commands:
  serve        serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...)
  generate     generate once from the shell, optionally constrained by a JSON schema
  train-eagle  train an EAGLE draft head for a model (speculative decoding)

run `constrained-spec <command> --help` for a command's flags."""

_EPILOG_SERVE = """\
examples:
  constrained-spec serve                                   # SmolLM2-135M-Instruct on 127.0.0.1:8000
  constrained-spec serve --model ./Qwen2.5-0.5B-Instruct --port 9000 --api-key secret
  CONSTRAINED_SPEC_API_KEY=secret constrained-spec serve --host 0.0.0.0

then:
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{
    "model": "smollm2-135m", "messages": [{"role": "user", "content": "Describe a cat"}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "cat",
      "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}}'"""

_EPILOG_GENERATE = """\
examples:
  constrained-spec generate "Write a haiku about the sea"
  constrained-spec generate "Describe a person" --schema person.json
  constrained-spec generate "Is the sky blue?" --choice yes no
  constrained-spec generate "Today's date:" --regex '\\d{4}-\\d{2}-\\d{2}' --raw
  echo "List three fruits as JSON" | constrained-spec generate - --json"""


def _engine_config_class():
    """EngineConfig without importing the engine package (and torch): keeps --help fast."""
    mod = sys.modules.get("constrained_spec.engine.config")
    if mod is not None:
        return mod.EngineConfig
    path = Path(__file__).parent / "engine" / "config.py"
    try:
        spec = importlib.util.spec_from_file_location("_constrained_spec_engine_config", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look the module up while processing the class
        spec.loader.exec_module(mod)
        return mod.EngineConfig
    except Exception:
        from .engine.config import EngineConfig
        return EngineConfig


def _train_config_class():
    """TrainConfig without importing the training package (and torch), as for EngineConfig."""
    path = Path(__file__).parent / "training" / "eagle_config.py"
    try:
        spec = importlib.util.spec_from_file_location("_constrained_spec_eagle_config", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod.TrainConfig
    except Exception:
        from .training.eagle_config import TrainConfig
        return TrainConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _auto_type(default: Any, annotation: str):
    if isinstance(default, bool):
        return bool
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    ann = str(annotation)
    if "float" in ann:
        return float
    if "int" in ann:
        return int
    return str


_ENGINE_CONFIG = _engine_config_class()  # the engine options' own ranges and choices (`EngineConfig.problem`)
_CHOICES = _ENGINE_CONFIG.CHOICES
# an engine option's name in a sentence of `EngineConfig.problem`, which the CLI says as its flag
_FIELD = re.compile(r"\b(?:" + "|".join(f.name for f in dataclasses.fields(_ENGINE_CONFIG)) + r")\b")

# Engine flags with hand-written help. Keys are EngineConfig field names.
_ENGINE_HELP: dict[str, tuple[str, dict]] = {
    "model": ("model", dict(metavar="PATH", help=f"a Hugging Face model folder (safetensors) or a GGUF file "
                                                 f"(default: {DEFAULT_MODEL_LABEL}, fetched and cached on first use)")),
    "device": ("model", dict(metavar="DEV", help="cpu, cuda, cuda:N, or auto: CUDA when available (default: auto)")),
    "dtype": ("model", dict(choices=_CHOICES["dtype"],
                            help="weights and KV-cache dtype; auto: bfloat16 on CUDA and on CPUs with native bfloat16 "
                                 "(AMX-BF16 or AVX512-BF16), float32 on other CPUs (default: auto)")),
    "attention_backend": ("model", dict(choices=_CHOICES["attention_backend"],
                                        help="attention kernels; auto: triton on CUDA, torch on CPU (default: auto)")),
    "max_model_len": ("model", dict(metavar="N", help="context length in tokens (prompt + completion); "
                                                      "default: the model's, capped at 8192")),
    "kv_cache_memory_gb": ("memory", dict(metavar="GIB",
                                          help="memory budget of the KV cache in GiB; default: 1 on CPU, 40%% of "
                                               "free GPU memory on CUDA")),
    "kv_cache_slots": ("memory", dict(metavar="N", help="exact KV-cache capacity in token slots; overrides "
                                                        "--kv-cache-memory-gb")),
    "max_running_requests": ("memory", dict(metavar="N", help="most requests decoded together in one batch "
                                                              "(default: %(default)s)")),
    "max_queued_requests": ("memory", dict(metavar="N", help="most requests waiting for a batch slot; past "
                                                             "running + queued the server answers 503 "
                                                             "(default: %(default)s)")),
    "disable_prefix_cache": ("memory", dict(help="turn off prefix caching (a radix tree of prompts and answers "
                                                 "whose K/V the engine keeps in the KV pool and reuses for "
                                                 "requests that start the same way; for A/B runs)")),
    "max_prefill_tokens": ("memory", dict(metavar="N", help="prompt tokens prefilled per step; longer prompts "
                                                            "are chunked (default: %(default)s)")),
    "grammar_backend": ("grammar", dict(choices=_CHOICES["grammar_backend"],
                                        help="which library enforces grammars; auto: llguidance for a grammar's first "
                                             "requests (JSON schemas, regexes, choices: compiled in ~1 ms), xgrammar "
                                             "(after our schema normalizer) once a repeated grammar is compiled for it "
                                             "in the background (cheaper masks), and where llguidance refuses a schema, "
                                             "and for EBNF; a request may name its own (grammar_backend) "
                                             "(default: %(default)s; docs/constraints.md)")),
    "grammar_threads": ("grammar", dict(metavar="N", help="threads compiling grammars; default: half the cores "
                                                          "available, 2 to 16")),
    "grammar_compile_timeout_s": ("grammar", dict(metavar="SEC", help="refuse a grammar (400) whose compile runs "
                                                                       "longer than this; time queued for a "
                                                                       "compile thread does not count, but a "
                                                                       "request queued twice this long gets "
                                                                       "503 (default: %(default)s)")),
    "grammar_cache_dir": ("grammar", dict(metavar="DIR", help="keep compiled grammars here across restarts, or "
                                                              "'none'; default: $CONSTRAINED_SPEC_GRAMMAR_CACHE_DIR "
                                                              "or ~/.cache/constrained-spec/grammars")),
    "grammar_disk_cache_mb": ("grammar", dict(metavar="MIB", help="disk space for the compiled grammars kept in "
                                                                  "--grammar-cache-dir under these compile options "
                                                                  "(and at most 4096 files); least recently used go "
                                                                  "first (default: %(default)s)")),
    "grammar_cache_mb": ("grammar", dict(metavar="MIB", help="memory for compiled grammars kept for reuse "
                                                             "(and at most 512 of them); least recently used go "
                                                             "first (default: %(default)s)")),
    "jump_forward": ("grammar", dict(help="emit text the grammar forces (e.g. JSON keys) without sampling it")),
    "grammar_mask_threads": ("grammar", dict(metavar="N", help="threads filling grammar masks and accepting tokens "
                                                               "(the step's thread and N - 1 workers); default: "
                                                               "the cores available but two, and but one per "
                                                               "front-end process in a split server, at most 16")),
    "grammar_paths_per_walk": ("grammar", dict(metavar="N", help="fewest draft paths per grammar walk: an EAGLE "
                                                                 "frontier's or verify tree's rows are cut into walks "
                                                                 "of N paths or more, each on its own fork of the "
                                                                 "request's matcher, while mask threads are free "
                                                                 "(default: %(default)s)")),
    "grammar_max_whitespace": ("grammar", dict(metavar="N", help="most whitespace characters in a row that "
                                                                 "JSON grammars (schemas, json_object) allow "
                                                                 "between JSON's tokens (after a brace, comma or "
                                                                 "colon); 0: compact JSON. A bound keeps a "
                                                                 "small model from looping on whitespace until "
                                                                 "max_tokens (default: %(default)s)")),
    "grammar_mask_budget_ms": ("grammar", dict(metavar="MS",
                                               help="per-step time limit for filling grammar masks: a request whose "
                                                    "mask is not ready by then skips the step (its output does not "
                                                    "change) instead of holding the batch (default: none, wait)")),
    "speculative_algorithm": ("spec", dict(metavar="NAME", choices=_CHOICES["speculative_algorithm"],
                                           help="speculative decoding: ngram (n-gram lookahead over prompts and "
                                                "outputs) or eagle (a draft head over the model's hidden states: "
                                                "the shipped one for the default model, or --eagle-head); "
                                                "default: off, plain decoding")),
    "eagle_head": ("spec", dict(metavar="DIR", help="EAGLE head folder (from `constrained-spec train-eagle`); "
                                                    "default: the head shipped for the default model")),
    "eagle_topk": ("spec", dict(metavar="K", help="EAGLE draft tree: children per node and nodes expanded per "
                                                  "depth (default: %(default)s)")),
    "eagle_depth": ("spec", dict(metavar="D", help="EAGLE draft tree: deepest node (default: %(default)s)")),
    "eagle_masked_depths": ("spec", dict(metavar="M", help="EAGLE draft tree: depths 1..M masked by the grammar "
                                                           "while drafted; each past the first costs a host sync "
                                                           "and a row fill per frontier node, deeper nodes the "
                                                           "grammar forbids are pruned before verify "
                                                           "(default: %(default)s)")),
    "eagle_fused_chain": ("spec", dict(help="EAGLE chains (--eagle-topk 1): verify each chain and draft the next "
                                            "in one launch, one read a step (naive EAGLE); greedy batches "
                                            "(default: on)")),
    "speculative_num_draft_tokens": ("spec", dict(metavar="N", help="nodes per draft tree, the last verified token "
                                                                    "included (default: %(default)s)")),
    "speculative_max_batch": ("spec", dict(metavar="N", help="decode batches larger than this run plainly "
                                                             "(default: %(default)s)")),
    "speculative_min_accept": ("spec", dict(metavar="X", help="with --speculative-policy always: mean accepted drafts per "
                                                              "request-step below which speculation pauses for 16 steps "
                                                              "(default: %(default)s)")),
    "speculative_policy": ("spec", dict(choices=_CHOICES["speculative_policy"],
                                        help="measured: per batch size, speculate while speculative steps measure "
                                             "faster than plain ones (CPU drafting and grammar work included); "
                                             "always: whenever the limits above allow (default: %(default)s)")),
    "ngram_branches": ("spec", dict(metavar="N", help="children per draft node: 1 drafts a chain, more a tree "
                                                      "(default: %(default)s)")),
    "ngram_max_match": ("spec", dict(metavar="N", help="longest context suffix matched in the trie "
                                                       "(default: %(default)s)")),
    "ngram_min_match": ("spec", dict(metavar="N", help="shortest context suffix matched (default: %(default)s)")),
    "ngram_capacity": ("spec", dict(metavar="N", help="trie nodes shared by all requests; least recently used "
                                                      "ones are evicted past it (default: %(default)s)")),
    "disable_overlap": ("perf", dict(help="process each step's results before launching the next (debugging)")),
    "disable_cuda_graph": ("perf", dict(help="run decode steps eagerly instead of replaying CUDA graphs")),
    "seed": ("perf", dict(metavar="N", help="base seed for requests that give none (default: %(default)s)")),
}

_GROUP_TITLES = {
    "model": "model",
    "memory": "memory and batching",
    "grammar": "grammar (structured output)",
    "spec": "speculative decoding",
    "perf": "performance and debugging",
}


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    EngineConfig = _engine_config_class()
    groups = {key: parser.add_argument_group(title) for key, title in _GROUP_TITLES.items()}
    for f in dataclasses.fields(EngineConfig):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        group_key, extra = _ENGINE_HELP.get(f.name, (None, {}))
        if group_key is None:
            group_key = "spec" if any(k in f.name for k in ("spec", "draft", "eagle", "ngram", "tree")) else "perf"
            extra = dict(help=f"engine option {f.name} (default: {default})")
            if _auto_type(default, f.type) is not bool:
                extra["metavar"] = {int: "N", float: "X"}.get(_auto_type(default, f.type), "VALUE")
        group = groups[group_key]
        typ = _auto_type(default, f.type)
        kw: dict[str, Any] = dict(dest=f.name, default=default)
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kw["type"] = typ
        kw.update(extra)
        names = [_flag(f.name)]
        if f.name == "kv_cache_memory_gb":
            names.append("--memory-budget")
        group.add_argument(*names, **kw)
    for key, g in groups.items():  # hide empty groups
        if not g._group_actions:
            parser._action_groups.remove(g)


def engine_config_from_args(args: argparse.Namespace):
    """The EngineConfig the parsed flags describe."""
    from .engine import EngineConfig
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="constrained-spec", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                           description="Serve the OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, "
                                       "/v1/models, /health and /metrics.",
                           epilog=_EPILOG_SERVE, formatter_class=argparse.RawDescriptionHelpFormatter)
    srv = serve.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to bind; use 0.0.0.0 to accept other machines (default: %(default)s)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    srv.add_argument("--api-key", metavar="KEY", default=None,
                     help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none)")
    srv.add_argument("--served-model-name", metavar="NAME", default=None,
                     help="the model id clients send and /v1/models lists (default: the model's name)")
    srv.add_argument("--allowed-origins", default="*", metavar="ORIGINS",
                     help="comma-separated origins browsers may call from (CORS), '*' any; '' none "
                          "(default: %(default)s)")
    srv.add_argument("--max-body-mb", type=float, default=8.0, metavar="MB",
                     help="largest request body accepted; larger ones get 413 (default: %(default)s)")
    srv.add_argument("--max-pending-requests", type=int, default=None, metavar="N",
                     help="most generation requests in flight before 503 + Retry-After "
                          "(default: max running + max queued)")
    srv.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                     help="completion limit for chat requests that set none (default: the rest of the context)")
    srv.add_argument("--response-store", metavar="FILE", default=None,
                     help="keep the stored Responses (/v1/responses with store) in this SQLite file, so that a "
                          "restarted server still has them (default: in memory only)")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="log verbosity (default: %(default)s)")
    srv.add_argument("--single-process", action="store_true",
                     help="run the engine inside the HTTP server's process, sharing its GIL (the layout before "
                          "the engine got a process of its own; slower from ~64 clients up, kept for A/B "
                          "comparison). Default: the engine runs in its own process")
    srv.add_argument("--frontends", type=int, default=None, metavar="N",
                     help="HTTP front-end processes sharing the port, each connected to the engine process: "
                          "they parse, tokenize and stream for their clients in parallel (default: one per four "
                          "cores, 1 to 4; ignored with --single-process)")
    _add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate once from the shell",
                         description="Load the model, generate one completion for PROMPT and print it to stdout "
                                     "as it is produced. Logs go to stderr.",
                         epilog=_EPILOG_GENERATE, formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompt", help="the prompt; '-' reads it from stdin")
    g = gen.add_argument_group("constraint (at most one)")
    cons = g.add_mutually_exclusive_group()
    cons.add_argument("--schema", metavar="FILE", help="a JSON schema file; the output is JSON that validates")
    cons.add_argument("--json", action="store_true", help="the output is any JSON object")
    cons.add_argument("--regex", metavar="RE", help="the output matches this regular expression")
    cons.add_argument("--ebnf", metavar="FILE", help="an EBNF grammar file (start rule 'root')")
    cons.add_argument("--choice", nargs="+", metavar="TEXT", help="the output is exactly one of these strings")
    s = gen.add_argument_group("sampling")
    s.add_argument("--system", metavar="TEXT", help="a system message")
    s.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    s.add_argument("--max-tokens", type=int, default=256, metavar="N", help="most tokens to generate "
                                                                            "(default: %(default)s)")
    s.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (default: %(default)s)")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default: %(default)s)")
    s.add_argument("--request-seed", type=int, default=None, metavar="N", dest="request_seed",
                   help="seed for this generation")
    s.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="log verbosity on stderr (default: %(default)s)")
    _add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    train = sub.add_parser("train-eagle", help="train an EAGLE draft head for a model",
                           description="Train an EAGLE draft head for MODEL on answers MODEL generates itself "
                                       "(JSON-schema tasks and general instructions), and write it to DIR: "
                                       "model.safetensors, config.json (how it was made), train_log.json and "
                                       "train_curves.png. Use it with --speculative-algorithm eagle --eagle-head DIR.",
                           epilog="example:\n  constrained-spec train-eagle --out heads/smollm2 --train-minutes 4",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_train_flags(train)
    train.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="log verbosity on stderr (default: %(default)s)")
    train.set_defaults(func=cmd_train_eagle)
    return parser


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `training.eagle_config.TrainConfig` field."""
    for f in dataclasses.fields(_train_config_class()):
        if f.name == "out":
            parser.add_argument("--out", required=True, metavar="DIR", help="folder the head is written to")
            continue
        default = f.default
        kind = _auto_type(default, f.type) if default is not None else str
        text = f.metadata["help"]  # (a field without a default value says what None means)
        choices = _ENGINE_HELP.get(f.name, (None, {}))[1].get("choices")  # --dtype: serve's choices
        parser.add_argument(_flag(f.name), type=kind, default=default, choices=choices,
                            help=text if default is None else f"{text} (default: %(default)s)")


def cmd_train_eagle(args: argparse.Namespace) -> int:
    from .training.eagle import train_eagle
    from .training.eagle_config import TrainConfig
    setup_logging(args.log_level)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    out = train_eagle(TrainConfig(**values))
    print(out)
    return 0


def _version() -> str:
    try:
        from . import __version__
        return __version__
    except Exception:
        return "0"


def describe_engine(engine) -> str:
    """One line: model, device, dtype, attention, KV capacity, context."""
    runner = getattr(engine, "runner", None)
    pool = getattr(runner, "pool", None)
    cap = getattr(pool, "capacity", None)
    dtype = getattr(runner, "dtype", None) or getattr(engine.config, "dtype", "?")
    backend = getattr(runner, "attention_backend", None) or getattr(runner, "backend", None)
    backend_name = getattr(backend, "name", None) or (backend.__class__.__name__ if backend is not None
                                                      else engine.config.attention_backend)
    parts = [f"model {engine.model_name}", f"device {engine.device}", f"dtype {str(dtype).replace('torch.', '')}",
             f"attention {backend_name}"]
    if cap is not None:
        parts.append(f"KV capacity {cap} tokens")
    parts.append(f"max context {engine.max_context}")
    return ", ".join(parts)


def _port_taken(host: str, port: int) -> str | None:
    """Why `serve` could not listen on host:port, found before the model loads (a probe, closed at
    once: the server binds for real once it is ready), or None."""
    import socket
    try:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET):
            return None
    except OSError as e:
        return e.strerror or str(e)


def cmd_serve(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    taken = _port_taken(args.host, args.port)
    if taken is not None:
        print(f"constrained-spec serve: error: cannot listen on {args.host} port {args.port}: {taken}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    from .server.frontends import default_frontends, remove_metrics_dir, use_shared_metrics
    n_frontends = 1 if args.single_process else (args.frontends or default_frontends())
    metrics_dir = None
    if n_frontends > 1:
        metrics_dir = use_shared_metrics()  # before prometheus_client is imported (by the app)
    from .engine.config import default_mask_threads
    from .server.app import ServerConfig, create_app
    from .server.runner import run_server

    config = engine_config_from_args(args)
    if not args.single_process and config.grammar_mask_threads is None:
        config.grammar_mask_threads = default_mask_threads(reserved=n_frontends)  # the front-ends' cores
    log.info("loading %s on %s%s ...", config.model or DEFAULT_MODEL_LABEL, config.device,
             " (in this process)" if args.single_process else " in the engine process")
    if args.single_process:
        from .engine import Engine
        engine = Engine(config)
        engine.grammar.warm_up()  # the first grammar request would otherwise pay it
        log.info("engine ready: %s", describe_engine(engine))
    else:
        from .server.engine_process import EngineProcess
        try:
            process = EngineProcess(config, response_store=args.response_store)
        except (RuntimeError, TimeoutError) as e:
            log.error("%s", e)
            return 1
        process.supervise()  # a crashed engine process is started again; the front-ends reconnect
        engine = process.connect(owns_process=True)
        info = process.info
        log.info("engine ready in process %d: model %s, device %s, dtype %s, KV capacity %d tokens, max context %d",
                 info.pid, info.model_name, info.device, info.dtype, info.kv_capacity, info.max_context)
    server_config = ServerConfig(api_key=api_key, served_model_name=args.served_model_name,
                                 max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                                 max_pending_requests=args.max_pending_requests,  # each front-end admits its share
                                 default_max_tokens=args.default_max_tokens, frontends=n_frontends,
                                 response_store=args.response_store,
                                 allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()))
    # with other front-ends, the engine stops after them (below), not with this app; in one process,
    # below too, where a grammar compile still running can be left to the process's end
    try:
        app = create_app(engine, server_config, owns_engine=n_frontends == 1 and not args.single_process)
    except RuntimeError as e:  # an unusable --response-store file (single-process: the store is this process's)
        log.error("%s", e)
        engine.shutdown()
        if metrics_dir is not None:
            remove_metrics_dir(metrics_dir)
        return 1
    host_shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host_shown}:{args.port}"
    served = args.served_model_name or engine.model_name
    log.info("serving model '%s' at %s/v1 (OpenAI base URL); health %s/health, metrics %s/metrics, docs %s/docs",
             served, url, url, url, url)
    if api_key:
        log.info("API key required on /v1/*: send 'Authorization: Bearer <key>'")
    elif args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who can reach it can use it", args.host)
    # uvicorn re-raises the SIGTERM or SIGINT (Ctrl-C) it handled once it has drained: exit through the
    # `finally` below (front-ends, then the engine) rather than die of it
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    sock = others = None
    if n_frontends > 1:
        from .server.frontends import FrontendProcesses, bind_socket
        try:
            sock = bind_socket(args.host, args.port)
        except OSError as e:
            log.error("cannot listen on %s port %d: %s", args.host, args.port, e.strerror or e)
            engine.shutdown()
            if metrics_dir is not None:
                remove_metrics_dir(metrics_dir)
            return 1
        others = FrontendProcesses(n_frontends, info, server_config, sock, args.log_level)
        log.info("%d front-end processes share the port (this one and pids %s)", n_frontends,
                 ", ".join(map(str, others.pids())))
    from .cpus import name_os_thread
    name_os_thread("cs-server" if args.single_process else "cs-frontend")  # front-end 0 (ps, top)

    def on_shutdown(force: bool) -> None:  # the drain begins: no engine restart now, the others drain too
        if not args.single_process:
            process.begin_shutdown()
        if others is not None:
            others.begin_stop(force)

    try:
        run_server(app, host=args.host, port=args.port, log_level=args.log_level, sock=sock, on_shutdown=on_shutdown)
    finally:
        if others is not None:
            others.stop()
        compiles_ended = True
        try:
            if args.single_process:
                from .engine.engine import EXIT_COMPILE_WAIT_S
                compiles_ended = engine.shutdown(compile_wait_s=EXIT_COMPILE_WAIT_S)
            else:
                engine.shutdown()
        except Exception:
            log.exception("engine shutdown failed")
        if metrics_dir is not None:
            remove_metrics_dir(metrics_dir)
        if not compiles_ended:  # a compile thread inside native code would abort the interpreter's teardown
            logging.shutdown()
            os._exit(0)
    return 0


def _bad_flag(problem: str) -> SystemExit:
    """Exit 2 with one line, as check_args' refusals: for what only reading a file finds."""
    print(f"constrained-spec: error: {problem}", file=sys.stderr)
    return SystemExit(2)


def _grammar_from_args(args: argparse.Namespace):
    """The constraint the flags ask for, checked as the engine will check it: a bad one exits 2 with
    one line (QA 1130: an array as --schema, an empty --ebnf file or --choice "" were a traceback,
    and --regex "" ran unconstrained)."""
    from .grammar import GrammarError
    try:
        return _grammar_spec_from_args(args)
    except GrammarError as e:
        raise _bad_flag(str(e))


def _grammar_spec_from_args(args: argparse.Namespace):
    from .grammar import GrammarSpec
    if args.schema:
        try:
            schema = json.loads(Path(args.schema).read_text())
        except OSError as e:
            raise _bad_flag(f"--schema {args.schema}: cannot read it: {e.strerror or e}")
        except ValueError as e:
            raise _bad_flag(f"--schema {args.schema}: not JSON: {e}")
        return GrammarSpec.json_schema(schema, strict=True), schema
    if args.json:
        return GrammarSpec.json_object(), None
    if args.regex is not None:
        return GrammarSpec.regex(args.regex), None
    if args.ebnf:
        try:
            return GrammarSpec.ebnf(Path(args.ebnf).read_text()), None
        except OSError as e:
            raise _bad_flag(f"--ebnf {args.ebnf}: cannot read it: {e.strerror or e}")
    if args.choice:
        return GrammarSpec.choice(list(args.choice)), None
    return None, None


def cmd_generate(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    from .engine import Engine, RequestError
    from .grammar import GrammarError
    from .sampling_params import SamplingParams

    grammar, schema = _grammar_from_args(args)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.request_seed)
    except ValueError as e:  # (the flag's name, not the parameter's: --seed is the engine's)
        raise _bad_flag(str(e).replace("seed", "--request-seed", 1) if "seed" in str(e) else str(e))
    if args.raw and args.system:
        raise _bad_flag("--system needs the chat template, which --raw leaves out")
    engine = Engine(engine_config_from_args(args))
    try:
        log.info("engine ready: %s", describe_engine(engine))
        if grammar is not None:
            try:
                engine.compile_grammar(grammar)
            except GrammarError as e:
                print(f"constrained-spec: {e}", file=sys.stderr)
                return 2
        if args.raw:
            ids: str | list[int] = prompt
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}]
            ids = engine.chat_prompt(messages)
        pieces = []
        final = None
        try:
            outputs = engine.stream(ids, params, grammar)
            first = next(outputs)
        except RequestError as e:  # a prompt past the context or the KV cache, or empty
            print(f"constrained-spec: {e}", file=sys.stderr)
            return 2
        for out in itertools.chain([first], outputs):
            if out.new_text:
                pieces.append(out.new_text)
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                final = out
        sys.stdout.write("\n")
        sys.stdout.flush()
        reason = getattr(final.finish_reason, "value", final.finish_reason) if final else "?"
        log.info("finish_reason=%s prompt_tokens=%s completion_tokens=%s", reason,
                 final.prompt_tokens if final else "?", final.completion_tokens if final else "?")
        if final is not None and reason == "error":
            print(f"constrained-spec: generation failed: {final.error}", file=sys.stderr)
            return 1
        if grammar is not None and (schema is not None or args.json) and reason == "length":
            print("constrained-spec: stopped at --max-tokens before the JSON was complete", file=sys.stderr)
            return 3
        return 0
    finally:
        engine.shutdown()


# flags' smallest values (those a subcommand has): a value below made a server that never admitted a
# request, or failed late with a traceback
_AT_LEAST = {**_ENGINE_CONFIG.AT_LEAST, "port": 0, "frontends": 1, "max_pending_requests": 1, "default_max_tokens": 1,
             "max_tokens": 1, "temperature": 0.0, "top_p": 0.0,
             # train-eagle's: fewer than 2 answers (prompts), or sequences of a token, leave nothing to train on
             "prompts": 2, "json_share": 0.0, "gen_batch": 1, "gen_minutes": 0.0, "max_len": 2, "batch_tokens": 1,
             "max_steps": 0, "p_weight": 0.0, "noise": 0.0, "unroll": 1, "eval_prompts": 0, "draft_tokens": 2}
_AT_LEAST_IN = {"train-eagle": {"max_tokens": 2}}  # a subcommand's own smallest values, over the above
_AT_MOST = {"port": 65535, "top_p": 1.0, "temperature": 2.0, "json_share": 1.0}
_POSITIVE = (*_ENGINE_CONFIG.POSITIVE, "max_body_mb", "grammar_mask_budget_ms", "train_minutes", "lr")
_DEVICE = _ENGINE_CONFIG.DEVICE


def check_args(args: argparse.Namespace) -> str | None:
    """What argparse's types cannot say, checked before anything loads: ranges, a model that is a
    path or an alias, CUDA where a CUDA device is asked for. Returns the problem, or None."""
    for name, low in {**_AT_LEAST, **_AT_LEAST_IN.get(getattr(args, "command", None), {})}.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            return f"--{name.replace('_', '-')} must be at least {low}; got {value}"
    for name, high in _AT_MOST.items():
        value = getattr(args, name, None)
        if value is not None and value > high:
            return f"--{name.replace('_', '-')} must be at most {high}; got {value}"
    for name in _POSITIVE:
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            return f"--{name.replace('_', '-')} must be positive; got {value}"
    problem = _check_combinations(args)
    if problem is not None:
        return problem
    model = getattr(args, "model", None)
    if model is not None and not model.strip():  # (it loaded the default model)
        return "--model is empty: give a path or an alias, or leave the flag out for the default model"
    if model and model.strip():
        from .models.registry import MODELS, lookup_alias
        if not Path(os.path.expanduser(model.strip())).exists() and lookup_alias(model) is None:
            return f"--model {model!r} is neither an existing path nor a known alias ({', '.join(sorted(MODELS))})"
    device = getattr(args, "device", None)
    if isinstance(device, str) and not _DEVICE.fullmatch(device):
        return f"--device must be cpu, cuda, cuda:N or auto; got {device!r}"
    if isinstance(device, str) and device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            return f"--device {device}: CUDA is not available here (torch {torch.__version__})"
    backend = getattr(args, "attention_backend", None)
    if backend in ("triton", "flashinfer") and device in ("cpu", "auto"):  # (refused after the load, before)
        import torch
        if device == "cpu" or not torch.cuda.is_available():
            return f"--attention-backend {backend} needs a CUDA device; use --attention-backend torch on the CPU"
    return None


def _check_combinations(args: argparse.Namespace) -> str | None:
    """Flags whose valid range depends on another's (the engine's own rules, which it raised only
    once the model had loaded), and paths that are not there: a draft head folder, the folder of a
    --response-store file (which would be created, folders and all, under a mistyped path)."""
    store = getattr(args, "response_store", None)
    if store and not Path(os.path.expanduser(store)).parent.is_dir():
        return f"--response-store {store}: the folder {Path(os.path.expanduser(store)).parent} does not exist"
    head = getattr(args, "eagle_head", None)
    if head:
        folder = Path(os.path.expanduser(head))
        if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
            return f"--eagle-head {head}: no EAGLE head there (expected a folder with config.json and model.safetensors)"
    if getattr(args, "command", None) == "train-eagle":  # its acceptance check's tree: --draft-tokens
        if not args.eagle_depth < args.draft_tokens:
            return f"--eagle-depth must be below --draft-tokens ({args.draft_tokens}); got {args.eagle_depth}"
        return None
    if not hasattr(args, "speculative_algorithm"):
        return None
    # the engine's own rules between its options (`EngineConfig.problem`), in flags
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(_ENGINE_CONFIG) if hasattr(args, f.name)}
    problem = _ENGINE_CONFIG(**values).problem()
    return None if problem is None else _FIELD.sub(lambda m: _flag(m.group(0)), problem)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    problem = check_args(args)
    if problem is not None:
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
