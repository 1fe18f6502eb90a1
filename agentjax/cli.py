"""The `agentjax` command line: `serve`, `generate`, `router`, `bench` and `sweep`.

    agentjax serve [--model SPEC] [--host 127.0.0.1] [--port 8000] [--api-key K] ...
    agentjax generate --prompt "The capital of France is" [--model SPEC] [--max-tokens 32]
    agentjax router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 [--policy sticky]
    agentjax bench {agentx,report,sweep-concurrency,kv-sim} ...
    agentjax sweep {simulate,saturation,pd} ...

Every flag's help shows its default. The global flags (`--log-level`, `--quiet`) go before or after
the subcommand. Progress and logs go to stderr; results to stdout.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from agentjax import __version__
from agentjax.engine_flags import add_engine_flags, engine_args
from agentjax.errors import AgentjaxError
from agentjax.progress import is_quiet, set_quiet

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Libraries whose INFO lines (checkpoint internals, backend probing, one line per HTTP request) would
# bury agentjax's own; they speak at WARNING unless --log-level DEBUG.
NOISY_LOGGERS = ("absl", "jax", "orbax", "httpx", "httpcore", "urllib3", "filelock")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: X)` to every option's help that does not already say its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text.lower() or (
                action.default is argparse.SUPPRESS and not hasattr(action, "shown_default")):
            return text
        if action.required:
            return f"{text} (required)"
        return f"{text} (default: {describe_default(action).replace('%', '%%')})"


    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return {int: "N", float: "NUM"}.get(action.type) or super()._get_default_metavar_for_optional(action)


def describe_default(action: argparse.Action) -> str:
    """How a flag's default reads in help and in docs/configuration.md."""
    if hasattr(action, "shown_default"):
        return action.shown_default
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    if action.default is None:
        return "none"
    if isinstance(action.default, bool):
        return "on" if action.default else "off"
    if isinstance(action.default, list):
        return ",".join(map(str, action.default)) or "none"
    return str(action.default)


def add_global_flags(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """`--log-level` and `--quiet`. Subcommands take them too, with no default of their own, so a
    value given after the subcommand wins and one given before it still counts."""
    group = parser.add_argument_group("Logging", "what reaches stderr")
    keep = {} if defaults else {"default": argparse.SUPPRESS}
    level = group.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, **({"default": "INFO"} | keep),
                               help="log level of agentjax's messages; progress lines and the ready line are INFO")
    quiet = group.add_argument("-q", "--quiet", action="store_true", **({"default": False} | keep),
                               help="no progress bars or progress lines: only warnings, errors and results (sets "
                                    "--log-level WARNING)")
    level.shown_default, quiet.shown_default = "INFO", "off"


def cmd_generate(args: argparse.Namespace) -> int:
    from agentjax import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(args.model, **_engine_args(args))
    note = (lambda text: None) if is_quiet() else (lambda text: print(f"[agentjax] {text}", file=sys.stderr))
    note(f"loaded {llm.model_config.name} in {time.perf_counter() - started:.1f}s")
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    started = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], sampling)
    else:
        out = llm.generate([args.prompt], sampling)[0]
    elapsed = time.perf_counter() - started
    print(out.text)
    note(f"{len(out.token_ids)} tokens in {elapsed:.1f}s (first call includes compilation), "
         f"finish_reason={out.finish_reason}")
    return 0


def _engine_args(args: argparse.Namespace) -> dict:
    return engine_args(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from agentjax.server.launcher import cmd_serve as serve

    return serve(args, _engine_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentjax", formatter_class=HelpFormatter,
                                     description="A JAX serving stack for agentic LLM traffic.")
    parser.add_argument("--version", action="version", version=f"agentjax {__version__}")
    add_global_flags(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from agentjax.server.launcher import add_serve_arguments

    srv = sub.add_parser("serve", help="serve the model over the OpenAI and Anthropic HTTP APIs",
                         description="Serve a model over the OpenAI (chat, completions, responses) and Anthropic "
                                     "(messages) HTTP APIs.", formatter_class=HelpFormatter)
    add_engine_flags(srv)
    add_serve_arguments(srv)
    srv.set_defaults(handler=cmd_serve)

    gen = sub.add_parser("generate", help="generate text offline from one prompt",
                         description="Load a model and complete one prompt, without a server.",
                         formatter_class=HelpFormatter)
    request = gen.add_argument_group("Request", "the one prompt and its sampling")
    request.add_argument("--prompt", required=True, help="the prompt text")
    request.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    request.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    request.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    add_engine_flags(gen)
    gen.set_defaults(handler=cmd_generate)

    from agentjax.router.launcher import add_router_arguments, cmd_router

    router = sub.add_parser("router", help="route OpenAI/Anthropic traffic over several agentjax serve replicas",
                            description="One OpenAI- and Anthropic-compatible front over several `agentjax serve` "
                                        "replicas (no model, no jax).", formatter_class=HelpFormatter)
    add_router_arguments(router)
    router.set_defaults(handler=cmd_router)
    from agentjax.bench.cli import add_bench_parser
    from agentjax.bench.sweep_cli import add_sweep_parser

    add_bench_parser(sub, HelpFormatter)
    add_sweep_parser(sub, HelpFormatter)
    for subparser in all_subparsers(parser):
        add_global_flags(subparser, defaults=False)
    return parser


def all_subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every subcommand's parser (`bench` and `bench agentx` alike), depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += [child, *all_subparsers(child)]
    return found


def subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """`("bench", "agentx")` -> its parser, for every leaf subcommand."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.update(subcommands(child, (*prefix, name)) or {(*prefix, name): child})
    return found


def configure_logging(level: str, quiet: bool) -> None:
    level = "WARNING" if quiet and level in ("DEBUG", "INFO") else level
    set_quiet(quiet)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "DEBUG":
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLevelName(level)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.quiet)
    if args.quiet:
        args.log_level = "WARNING"
    try:
        return args.handler(args)
    except AgentjaxError as exc:
        print(f"agentjax: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
