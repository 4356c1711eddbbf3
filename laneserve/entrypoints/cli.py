"""`laneserve generate | serve | bench | profile | train-mtp`."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from laneserve.engine_args import EngineArgs
from laneserve.entrypoints.sampling_flags import add_sampling_flags, sampling_params_from

log = logging.getLogger("laneserve")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help, unless the help already says it
    (defaults of None mean "not set": their help explains what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default in (None, argparse.SUPPRESS):
            return text
        if "%(default)" in text or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Subcommand parsers reject unknown flags themselves, so the error shows the
    subcommand's usage rather than the top-level one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    # NOTE: typeshed declares overloads on `namespace`; one signature serves both here
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extra = super().parse_known_args(args, namespace)
        if extra and self._subparsers is None:  # a leaf: nothing below may claim them
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="laneserve",
        description="LLM inference and serving on PyTorch (vLLM-compatible interface).",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="logging threshold",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_generate(sub)
    from laneserve.entrypoints import commands

    commands.register(sub)
    return parser


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt (offline)")
    p.add_argument("prompt", help="the prompt text")
    add_sampling_flags(p, max_tokens=128, temperature=0.0, top_p=1.0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="print the text when generation ends instead of streaming it",
    )
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_generate)


def run_generate(ns: argparse.Namespace) -> int:
    from laneserve import LLM

    args = EngineArgs.from_cli(ns)
    params = sampling_params_from(ns)
    llm = LLM(**vars(args))
    try:
        prompt = ns.prompt
        if ns.chat:
            prompt = llm.chat_prompt([{"role": "user", "content": ns.prompt}])
        start = time.perf_counter()
        if ns.stream:
            stream = llm.stream(prompt, params)
            for piece in stream:
                print(piece, end="", flush=True)
            print()
            out = stream.output
            assert out is not None  # the loop ran to the end
        else:
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            print(out.outputs[0].text)
        elapsed = time.perf_counter() - start
        completion = out.outputs[0]
        n = len(completion.token_ids)
        stats = llm.get_stats()
        line = (
            f"[{n} tokens in {elapsed:.2f} s = {n / elapsed:.1f} tokens/s, "
            f"prompt {len(out.prompt_token_ids)} tokens, finish_reason={completion.finish_reason}"
        )
        if "spec_num_drafts" in stats:
            line += (
                f", drafts {stats['spec_num_drafts']} accepted {stats['spec_num_accepted']} "
                f"({100 * stats['spec_acceptance_rate']:.0f}%)"
            )
        print(line + "]", file=sys.stderr)
        return 0 if completion.finish_reason != "error" else 1
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    _setup_logging(ns.log_level)
    try:
        return int(ns.func(ns) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the requests were aborted and the worker stopped
        print("\n(interrupted)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
