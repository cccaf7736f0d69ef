"""The `loraplex` console script: a table of subcommands, each a `main(argv) -> int` in its own module.

Modules are imported only when their command runs, so `loraplex --help` never pays for torch or the
services. Adding a command is one line in COMMANDS.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name: ("module:function", one-line summary shown by `loraplex --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "make-model": ("shared.tiny_model:main", "write a tiny random Llama checkpoint with tokenizer"),
    "make-adapters": ("shared.make_adapters:main", "write N random PEFT LoRA adapters for a base model"),
    "up": ("services.launcher:main", "start every service in the foreground (embedded default with no arguments)"),
    "adapters": ("shared.adapters_client:main", "add, list or remove adapters on a running server"),
    "status": ("shared.status_cli:main", "summarize a running server: traffic, latency, workers, pool, adapters per tier"),
    "bench": ("bench.cli:main", "benchmarks: run a point or a resumable sweep, plot results, measure the roofline"),
}


def _parser() -> argparse.ArgumentParser:
    width = max(len(name) for name in COMMANDS)
    listing = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="loraplex",
        description="Serve one base LLM with thousands of LoRA adapters from a unified paged GPU pool.",
        epilog=f"commands:\n{listing}\n\n`loraplex COMMAND --help` shows a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("command", metavar="COMMAND", choices=sorted(COMMANDS), help="one of: " + ", ".join(COMMANDS))
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("loraplex")
    except Exception:  # running from a source tree that was never installed
        return "unknown"


def resolve(command: str):
    """The function that runs a command, imported on demand."""
    module_name, _, function = COMMANDS[command][0].partition(":")
    return getattr(importlib.import_module(module_name), function)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only the command name is parsed here; everything after it belongs to the command's own parser.
    args = _parser().parse_args(argv[:1])
    return int(resolve(args.command)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
