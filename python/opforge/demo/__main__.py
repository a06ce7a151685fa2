"""`python -m opforge.demo` (and `torchrun -m opforge.demo --parallel ddp|fsdp`): the demo's command line."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m opforge.demo"))
