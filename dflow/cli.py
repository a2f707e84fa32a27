"""`dflow` command line: a thin dispatcher. Each command lives in its own module, which
provides `add_parser(subparsers)`; bad input surfaces as one `error:` line and exit code 2, and
Ctrl-C (SIGINT) as one `interrupted` line and exit code 130 (128 + SIGINT), in every command. A
command that has something to say on an interruption raises KeyboardInterrupt(message); one that must
add no line (a DDP process whose main process says why) raises `dflow.errors.QuietInterrupt`."""

from __future__ import annotations

import argparse
import importlib
import sys

from dflow.errors import DFlowError, QuietInterrupt

COMMAND_MODULES = (
    "dflow.commands.generate",  # generate, init-drafter
    "dflow.commands.data",  # data
    "dflow.commands.features",  # features (the feature cache of `dflow train --feature-cache`)
    "dflow.commands.train",  # train
    "dflow.commands.bench",  # bench
    "dflow.commands.serve",  # serve (needs the vllm extra at run time)
    "dflow.commands.bench_serve",  # bench-serve (likewise)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflow", description="Lossless block-diffusion speculative decoding (DFlash / DFlow).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # a command not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # the imports take a while: Ctrl-C may come here too
        return args.func(args) or 0
    except DFlowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except QuietInterrupt:
        return 130
    except KeyboardInterrupt as e:
        # one write: the lines of processes sharing a stream (torchrun's) do not interleave
        sys.stderr.write(f"interrupted: {e}\n" if str(e) else "interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
