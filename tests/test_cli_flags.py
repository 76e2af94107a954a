"""Flags the command line refuses before anything loads (exit 2, one line saying which), as
docs/cli.md promises: train-eagle's ranges, serve's flags whose range depends on another's or
that name a path, generate's grammar files. None of these tests loads a model, but the last, which
checks what the engine does with a --max-model-len past the model's positions."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from constrained_spec.cli import build_parser, check_args, main


def refused(argv, capsys) -> str:
    """main(argv)'s one-line refusal (exit 2), checked; returns it."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, (e.value.code, err)
    return err


@pytest.mark.parametrize("flags, says", [
    (["--prompts", "0"], "--prompts must be at least 2"),  # loaded the model, then a RuntimeError
    (["--prompts", "1"], "--prompts must be at least 2"),
    (["--gen-batch", "0"], "--gen-batch must be at least 1"),  # a ValueError traceback
    (["--json-share", "2"], "--json-share must be at most 1.0"),
    (["--json-share", "-0.5"], "--json-share must be at least 0.0"),
    (["--train-minutes", "-1"], "--train-minutes must be positive"),
    (["--train-minutes", "0"], "--train-minutes must be positive"),  # a division by the budget
    (["--lr", "-1"], "--lr must be positive"),
    (["--gen-minutes", "-1"], "--gen-minutes must be at least 0.0"),
    (["--max-tokens", "1"], "--max-tokens must be at least 2"),  # answers of a token are dropped
    (["--max-len", "0"], "--max-len must be at least 2"),
    (["--batch-tokens", "0"], "--batch-tokens must be at least 1"),
    (["--max-steps", "-1"], "--max-steps must be at least 0"),
    (["--p-weight", "-1"], "--p-weight must be at least 0.0"),
    (["--noise", "-0.1"], "--noise must be at least 0.0"),
    (["--unroll", "0"], "--unroll must be at least 1"),
    (["--eval-prompts", "-1"], "--eval-prompts must be at least 0"),
    (["--draft-tokens", "1"], "--draft-tokens must be at least 2"),
    (["--eagle-depth", "8"], "--eagle-depth must be below --draft-tokens (8)"),
    (["--eagle-depth", "4", "--draft-tokens", "4"], "--eagle-depth must be below --draft-tokens (4)"),
])
def test_train_eagle_flags_are_range_checked(flags, says, capsys, tmp_path):
    out = tmp_path / "head"
    assert says in refused(["train-eagle", "--out", str(out), *flags], capsys)
    assert not out.exists()  # refused before anything ran


def test_train_eagle_dtype_is_a_choice(capsys, tmp_path):
    """As serve's --dtype: argparse refuses it (it was a ValueError traceback once the run began)."""
    with pytest.raises(SystemExit) as e:
        main(["train-eagle", "--out", str(tmp_path / "head"), "--dtype", "int8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--dtype: invalid choice: 'int8'" in err, err


def test_train_eagle_defaults_pass(tmp_path):
    assert check_args(build_parser().parse_args(["train-eagle", "--out", str(tmp_path / "h")])) is None


@pytest.mark.parametrize("flags, says", [
    (["--speculative-algorithm", "eagle", "--eagle-depth", "9"],
     "--eagle-depth must be below --speculative-num-draft-tokens (8); got 9"),
    (["--speculative-algorithm", "eagle", "--speculative-num-draft-tokens", "6"],
     "--eagle-depth must be below --speculative-num-draft-tokens (6); got 6"),
    (["--eagle-head", "/nonexistent"], "--eagle-head /nonexistent: no EAGLE head there"),
    (["--ngram-min-match", "9"], "--ngram-min-match (9) must not exceed --ngram-max-match (8)"),
    (["--ngram-max-match", "2", "--ngram-min-match", "3"], "--ngram-min-match (3) must not exceed --ngram-max-match (2)"),
    (["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "1"],
     "--speculative-num-draft-tokens must be at least 2 with --speculative-algorithm; got 1"),
    (["--speculative-min-accept", "-1"], "--speculative-min-accept must be at least 0.0"),
    (["--speculative-algorithm", "ngram", "--speculative-min-accept", "7.5"],
     "--speculative-min-accept must be at most 7"),
    (["--speculative-algorithm", "eagle", "--speculative-min-accept", "6.5"],
     "--speculative-min-accept must be at most 6"),
    (["--response-store", "/nonexistent/dir/x.sqlite"],
     "--response-store /nonexistent/dir/x.sqlite: the folder /nonexistent/dir does not exist"),
])
def test_serve_flags_that_depend_on_others(flags, says, capsys):
    """These got past the check: the engine refused them after the model had loaded (exit 1, a
    traceback), or they were taken (a drafter that drafts nothing, speculation that always pauses,
    a store file whose missing folders were created)."""
    assert says in refused(["serve", *flags], capsys)


@pytest.mark.parametrize("flags", [
    [], ["--speculative-algorithm", "eagle"], ["--speculative-algorithm", "ngram"],
    ["--speculative-num-draft-tokens", "1"],  # without speculation it is not used
    ["--speculative-algorithm", "ngram", "--speculative-min-accept", "7"],
    ["--speculative-algorithm", "eagle", "--speculative-min-accept", "6", "--eagle-depth", "6"],
    ["--ngram-min-match", "3", "--ngram-max-match", "3"],
])
def test_serve_flags_in_range_pass(flags, tmp_path):
    args = build_parser().parse_args(["serve", "--response-store", str(tmp_path / "new.sqlite"), *flags])
    assert check_args(args) is None


def test_an_eagle_head_folder_passes(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    args = build_parser().parse_args(["serve", "--speculative-algorithm", "eagle", "--eagle-head", str(tmp_path)])
    assert check_args(args) is None
    (tmp_path / "model.safetensors").unlink()
    assert "no EAGLE head there" in check_args(args)


def test_response_store_folder_is_not_created(capsys, tmp_path):
    missing = tmp_path / "no" / "such"
    assert "does not exist" in refused(["serve", "--response-store", str(missing / "x.sqlite")], capsys)
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("flag, content, says", [
    ("--schema", None, "--schema {path}: cannot read it: No such file or directory"),
    ("--schema", "{not json", "--schema {path}: not JSON: "),
    ("--ebnf", None, "--ebnf {path}: cannot read it: No such file or directory"),
])
def test_generate_bad_grammar_file_exits_2(flag, content, says, capsys, tmp_path):
    """docs/cli.md: exit 2 is a bad grammar or flag (these exited 1, the engine error's status);
    the file is read before the model loads."""
    path = tmp_path / "grammar"
    if content is not None:
        path.write_text(content)
    err = refused(["generate", "hi", flag, str(path)], capsys)
    assert err.startswith("constrained-spec: error: ") and says.format(path=path) in err, err


def test_max_model_len_past_the_model_is_capped_and_said(tiny_llama_dir, caplog):
    """The tiny model has 512 positions: a longer max_model_len is capped with a warning, and the
    engine's config reports the context it uses (it reported the value asked for)."""
    from constrained_spec.engine import Engine
    with caplog.at_level(logging.WARNING, logger="constrained_spec.engine.model_runner"):
        engine = Engine(model=tiny_llama_dir, device="cpu", dtype="float32", max_model_len=100000,
                        disable_prefix_cache=True)
    try:
        assert engine.max_context == 512 and engine.config.max_model_len == 512
        assert any("max_model_len 100000 is longer than the model's 512 positions; capped at 512" in r.getMessage()
                   for r in caplog.records), caplog.text
    finally:
        engine.shutdown()
    with caplog.at_level(logging.WARNING, logger="constrained_spec.engine.model_runner"):
        caplog.clear()
        engine = Engine(model=tiny_llama_dir, device="cpu", dtype="float32", max_model_len=100,
                        disable_prefix_cache=True)
    try:  # within the model's: as asked, nothing said
        assert engine.max_context == 100 and engine.config.max_model_len == 100
        assert "capped" not in caplog.text
    finally:
        engine.shutdown()


def test_the_default_context_is_capped_at_8192(tiny_llama_dir):
    """A model of more positions (Qwen2.5's 32,768) had its whole context by default, though the flag's
    help says "capped at 8192" (QA 1130c Qwen F3); --max-model-len still reaches past the cap."""
    import dataclasses
    from constrained_spec.engine import Engine
    from constrained_spec.models import load_model
    loaded = load_model(tiny_llama_dir, dtype="float32", device="cpu")
    loaded = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, max_position=32768))
    for asked, context in ((None, 8192), (10000, 10000)):
        engine = Engine(loaded=loaded, device="cpu", max_model_len=asked, kv_cache_slots=4096,
                        disable_prefix_cache=True)
        try:
            assert engine.max_context == min(context, 4096) and engine.runner.max_context == context
        finally:
            engine.shutdown()


def test_cli_md_lists_every_serve_flag():
    """docs/cli.md's tables name each flag `serve --help` has (two were missing)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = [s for a in serve._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    missing = [f for f in flags if f"`{f}" not in doc and f"`--no-{f[2:]}" not in doc]
    assert not missing, missing
