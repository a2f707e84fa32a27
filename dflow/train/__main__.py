"""`python -m dflow.train ARGS` == `dflow train ARGS`; the entry point for torchrun (DDP)."""

import sys

from dflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
