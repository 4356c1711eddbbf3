"""The command line: flags generated from `EngineArgs`, complete and fast `--help`,
errors that show the subcommand's usage."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import textwrap

import msgspec
import pytest

from laneserve.config import (
    SPECULATIVE_KEYS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SpeculativeConfig,
)
from laneserve.engine_args import EngineArgs, cli_flag
from laneserve.entrypoints.cli import build_parser, main

# every command that takes the engine flags
ENGINE_COMMANDS = (["generate"], ["serve"], ["bench", "offline"])


def _subparser(path: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _leaf_parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(path, parser)]
    return [
        leaf
        for name, child in subs[0].choices.items()
        for leaf in _leaf_parsers(child, (*path, name))
    ]


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=" ".join)
def test_every_engine_field_has_a_flag_with_help(command: list[str]) -> None:
    options = {opt: a for a in _subparser(command)._actions for opt in a.option_strings if a.help}
    for f in dataclasses.fields(EngineArgs):
        action = options.get(cli_flag(f))
        assert action is not None, f"{' '.join(command)}: no flag with help for {f.name}"
        assert action.dest == f.name


def test_every_flag_of_every_command_has_help_and_shows_its_default() -> None:
    leaves = _leaf_parsers(build_parser())
    assert {" ".join(p) for p, _ in leaves} >= {"generate", "serve", "bench offline"}
    for path, parser in leaves:
        text = parser.format_help()
        for a in parser._actions:
            if not a.option_strings or isinstance(a, argparse._HelpAction):
                continue
            where = f"{' '.join(path)} {a.option_strings[0]}"
            assert a.help, f"{where} has no help"
            assert "\n" not in a.help, f"{where}: help is not one line"
            if a.default is not None and not isinstance(a.default, bool):
                # argparse wraps lines: compare without the line breaks
                assert f"(default: {a.default})" in " ".join(text.split()), where


def test_defaults_agree_between_engine_args_config_and_cli(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # EngineArgs' defaults build exactly the config's own defaults
    monkeypatch.delenv("LANESERVE_WORKER_MODE", raising=False)
    cfg = EngineArgs(model="m").create_config()
    assert cfg == EngineConfig(model=ModelConfig(model="m"))
    # and the generated flags default to EngineArgs' values
    ns = build_parser().parse_args(["generate", "hello"])
    assert EngineArgs.from_cli(ns) == EngineArgs()
    ns = build_parser().parse_args(["bench", "offline"])
    assert EngineArgs.from_cli(ns) == EngineArgs()


def test_serve_runs_the_model_in_a_worker_process_by_default() -> None:
    ns = build_parser().parse_args(["serve"])
    assert EngineArgs.from_cli(ns) == EngineArgs(worker_mode="process")


def test_flags_parse_into_engine_args() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    ns = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--no-kernels",
            "--no-enable-prefix-caching",
            "--max-model-len",
            "64",
            "--kv-cache-memory",
            "0.5",
            "--dtype",
            "float32",
            "--speculative-config",
            spec,
        ]
    )
    args = EngineArgs.from_cli(ns)
    assert (args.use_kernels, args.enable_prefix_caching) == (False, False)
    assert (args.max_model_len, args.kv_cache_memory, args.dtype) == (64, 0.5, "float32")
    cfg = args.create_config()
    assert cfg.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=3)


def test_bad_choice_is_refused() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--dtype", "float8"])


def test_speculative_config_help_lists_every_key() -> None:
    text = " ".join(_subparser(["serve"]).format_help().split())
    names = [f.name for f in msgspec.structs.fields(SpeculativeConfig)]
    assert sorted(SPECULATIVE_KEYS) == sorted(names)
    for name in names:
        assert f"{name} (" in text, name
    assert "num_speculative_tokens (draft tokens per step, 1..8; default 1)" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--bogus"],
        ["generate", "hi", "--bogus"],
        ["bench", "offline", "--bogus"],
        ["train-mtp", "--out", "x", "--bogus"],
    ],
    ids=lambda argv: argv[0],
)
def test_unknown_flag_prints_the_subcommand_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    command = " ".join(a for a in argv[:2] if not a.startswith("-") and a != "hi")
    assert err.startswith(f"usage: laneserve {command} "), err
    assert "unrecognized arguments: --bogus" in err


def test_unknown_top_level_flag_prints_the_top_level_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--bogus", "generate", "hi"])
    assert capsys.readouterr().err.startswith("usage: laneserve [-h]")


def test_help_does_not_import_torch() -> None:
    """Building every parser and printing every help: no torch, transformers or web server."""
    code = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from laneserve.entrypoints.cli import main
        for argv in (["--help"], ["serve", "--help"], ["generate", "--help"],
                     ["bench", "offline", "--help"], ["train-mtp", "--help"]):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                main(argv)
        heavy = ("torch", "transformers", "safetensors", "numpy", "fastapi", "uvicorn")
        print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_vllm_style_serve_command_line_parses() -> None:
    ns = build_parser().parse_args(
        ["serve", "some/model", "--served-model-name", "a", "b", "--trust-remote-code",
         "--disable-log-requests", "--uvicorn-log-level", "info", "--tensor-parallel-size", "1",
         "--gpu-memory-utilization", "0.9", "--enforce-eager"]
    )  # fmt: skip
    assert ns.model_tag == "some/model" and ns.served_model_name == ["a", "b"]
    assert ns.trust_remote_code and ns.disable_log_requests and ns.uvicorn_log_level == "info"
    args = EngineArgs.from_cli(ns)
    assert args.gpu_memory_utilization == 0.9 and args.enforce_eager
    assert not EngineArgs.from_cli(build_parser().parse_args(["serve", "m"])).enforce_eager
    assert EngineArgs(model="m", enforce_eager=True).create_config().model.enforce_eager


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"tensor_parallel_size": 2, "worker_mode": "thread"}, "worker mode .process."),
        ({"gpu_memory_utilization": 0.9, "device": "cpu"}, "CUDA devices only.*--kv-cache-memory"),
    ],
)
def test_vllm_arguments_with_a_narrower_meaning_fail_clearly(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="m", **kwargs).create_config()


def test_gpu_memory_utilization_range_and_trust_remote_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LANESERVE_WORKER_MODE", raising=False)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(
            model=ModelConfig(model="m"),
            cache=CacheConfig(gpu_memory_utilization=1.5),
        ).validate()
    cfg = EngineArgs(model="m", trust_remote_code=True).create_config()
    assert cfg == EngineConfig(model=ModelConfig(model="m"))  # accepted, changes nothing


def test_serve_rejects_two_different_models(capsys: pytest.CaptureFixture) -> None:
    from laneserve.entrypoints.serve import run

    ns = build_parser().parse_args(["serve", "a", "--model", "b"])
    assert run(ns) == 2 and "two models" in capsys.readouterr().out


def test_serve_auto_tool_choice_needs_a_parser(capsys: pytest.CaptureFixture) -> None:
    from laneserve.entrypoints.serve import run

    ns = build_parser().parse_args(["serve", "--enable-auto-tool-choice"])
    assert run(ns) == 2 and "needs --tool-call-parser" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "granite"])


def test_worker_mode_default_is_the_process_unless_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LANESERVE_WORKER_MODE", raising=False)
    assert EngineArgs(model="m").create_config().worker.mode == "process"
    monkeypatch.setenv("LANESERVE_WORKER_MODE", "thread")
    assert EngineArgs(model="m").create_config().worker.mode == "thread"
    assert EngineArgs(model="m", worker_mode="process").create_config().worker.mode == "process"
    monkeypatch.setenv("LANESERVE_WORKER_MODE", "fork")
    with pytest.raises(ValueError, match="worker mode must be"):
        EngineArgs(model="m").create_config()
