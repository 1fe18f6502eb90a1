"""agentjax/cli.py: every flag's help states its default, global flags work on either side of the
subcommand, `--version`, and `--model` names every spec it accepts."""
from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib

import pytest

from agentjax import __version__
from agentjax.cli import HelpFormatter, build_parser, main, subcommands
from agentjax.config import EngineConfig
from agentjax.engine_flags import ENGINE_FIELDS, engine_args
from agentjax.model_specs import FULL_SIZE_NAMES, PRESET_NAMES
from checkpoints.embedded import EMBEDDED_MODELS
from tests.e2e.conftest import REPO


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_every_subcommand_is_known():
    assert set(subcommands(build_parser())) == {
        ("serve",), ("generate",), ("router",), ("bench", "agentx"), ("bench", "report"),
        ("bench", "sweep-concurrency"), ("bench", "kv-sim"), ("sweep", "simulate"), ("sweep", "saturation"),
        ("sweep", "pd")}


@pytest.mark.parametrize("command", sorted(subcommands(build_parser())), ids=" ".join)
def test_every_flag_has_help_that_states_its_default(command):
    parser = subcommands(build_parser())[command]
    formatter = HelpFormatter(prog="agentjax")
    for action in options(parser):
        assert action.help, f"{action.option_strings} has no help"
        shown = formatter._get_help_string(action) % {"default": action.default, "prog": "agentjax"}
        assert "default" in shown.lower() or shown.endswith("(required)"), (action.option_strings, shown)


def test_help_shows_the_defaults_the_issue_named(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--port", "8000"), ("--block-size", "16"), ("--max-num-batched-tokens", "2048"),
                          ("--max-num-seqs", "64"), ("--numerics", "fast")):
        assert re.search(rf"{flag} \S+ .*?\(default: {default}\)", text), flag


def test_global_flags_work_before_and_after_the_subcommand():
    parse = build_parser().parse_args
    assert parse(["serve"]).log_level == "INFO" and not parse(["serve"]).quiet
    assert parse(["--log-level", "debug", "serve"]).log_level == "DEBUG"
    assert parse(["serve", "--log-level", "debug"]).log_level == "DEBUG"
    assert parse(["--log-level", "error", "serve", "--log-level", "warning"]).log_level == "WARNING"
    assert parse(["bench", "kv-sim", "--lanes", "2", "--hbm-tokens", "1k", "-q"]).quiet
    assert parse(["router", "--quiet", "--replica", "http://h:1"]).quiet
    with pytest.raises(SystemExit):
        parse(["serve", "--log-level", "chatty"])


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"agentjax {__version__}"
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == __version__


def test_model_help_lists_every_spec_it_accepts():
    parser = subcommands(build_parser())[("serve",)]
    (model,) = [a for a in options(parser) if "--model" in a.option_strings]
    for name in (*EMBEDDED_MODELS, *(f"preset:{p}" for p in PRESET_NAMES)):
        assert name in model.help, name


def test_the_preset_names_match_the_presets():
    from agentjax.models.presets import FULL_SIZE_PRESETS, PRESETS

    assert PRESET_NAMES == tuple(PRESETS) and FULL_SIZE_NAMES == tuple(FULL_SIZE_PRESETS)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_engine_setting_is_a_flag_with_the_engine_default(command):
    args = build_parser().parse_args([command] + (["--prompt", "x"] if command == "generate" else []))
    assert engine_args(args) == {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name in ENGINE_FIELDS}
    assert EngineConfig(**engine_args(args)) == EngineConfig()


def test_flags_reach_the_engine_config():
    args = build_parser().parse_args(["serve", "--no-enable-prefix-caching", "--kv-policy", "lru", "--seed", "7",
                                      "--host-cache-gb", "2", "--max-model-len", "512"])
    config = EngineConfig(**engine_args(args))
    assert not config.enable_prefix_caching and config.kv_policy == "lru" and config.seed == 7
    assert config.host_cache_gb == 2 and config.max_model_len == 512


def test_served_model_name_and_api_key_flags(monkeypatch):
    from agentjax.server.launcher import served_model_name

    args = build_parser().parse_args(["serve", "--served-model-name", "claude-sonnet", "--api-key", "k"])
    assert served_model_name(args) == "claude-sonnet" and args.api_key == ["k"]
    monkeypatch.setenv("AGENTJAX_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key is None  # the env is read at start, not in --help
