"""`agentjax router` flags: several replicas after one flag or repeated flags, and clear errors."""
from __future__ import annotations

from agentjax.cli import build_parser, main


def test_replica_urls_may_follow_one_flag_or_repeat_it():
    args = build_parser().parse_args(["router", "--replica", "http://h:1", "http://h:2", "--replica", "http://h:3",
                                      "--policy", "queue"])
    assert args.replica == ["http://h:1", "http://h:2", "http://h:3"] and args.policy == "queue"


def test_bad_router_flags_exit_with_a_clear_message(capsys):
    assert main(["router"]) == 2
    assert "at least one replica" in capsys.readouterr().err
    assert main(["router", "--policy", "pools", "--replica", "http://h:1"]) == 2
    assert "--prefill-replica" in capsys.readouterr().err
    assert main(["router", "--replica", "h:1"]) == 2
    assert "must look like http://HOST:PORT" in capsys.readouterr().err


def test_the_operator_key_comes_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.setenv("AGENTJAX_OPERATOR_KEY", "from-env")
    assert build_parser().parse_args(["router", "--replica", "http://h:1"]).operator_key == "from-env"
    assert build_parser().parse_args(["router", "--replica", "http://h:1", "--operator-key", "ops"]).operator_key == "ops"
