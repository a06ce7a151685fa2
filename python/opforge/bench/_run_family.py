"""One op family's suite in a process of its own: ``python -m opforge.bench._run_family <module> <result.json>
<command> [args for its main()...]``, started by ``python -m opforge bench`` (`opforge.bench.cli`).

``<module>`` is the suite's module (``opforge.bench.suites.rms_norm``); its ``main(args)`` runs here, its output going
straight to this process's stdout and stderr, with ``<command>`` as the command line recorded in the CSV rows. Then
``<result.json>`` receives ``{"status": int, "error": str, "device_name": str, "rows": [Row fields...]}``: the
exit status of ``main()`` (1 when it raised), the exception as one line ("" when none), the device's name and the
rows the harness collected (`opforge.bench.harness._State.collected`), also those measured before a
failure. A family therefore cannot leave CUDA, RNG or torch.compile state behind for the next one, and a crash
(even one that poisons the CUDA context or kills the process) loses only that family.
"""
from __future__ import annotations

import importlib
import json
import sys
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

from . import harness


def one_line(e: BaseException) -> str:
    """``<type>: <first line of the message, at most 200 characters>``."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def run(module: str, result: Path, command: str, args: List[str]) -> int:
    """Run ``module``'s ``main(args)``, write ``result`` (see the module's docstring) and return the status."""
    harness._State.collected = []
    harness.set_command(command)
    status, error = 0, ""
    try:
        status = importlib.import_module(module).main(args) or 0
    except SystemExit as e:  # argparse, or a suite calling sys.exit
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which goes on with the next family)
        traceback.print_exc()
        status, error = 1, one_line(e)
    device = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--device"), "cpu")
    try:
        name = harness.device_name(device)
    except Exception:  # noqa: BLE001  (e.g. a CUDA context poisoned by the failure)
        name = ""
    payload = {"status": int(status), "error": error, "device_name": name,
               "rows": [asdict(r) for r in harness._State.collected]}
    result.write_text(json.dumps(payload))
    return int(status)


def main(argv: Optional[List[str]] = None) -> int:
    """The command line of the module's docstring; the suite's exit status (2 for a bad command line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) < 3:
        print("usage: python -m opforge.bench._run_family <module> <result.json> <command> [args...]",
              file=sys.stderr)
        return 2
    status = run(argv[0], Path(argv[1]), argv[2], argv[3:])
    sys.stdout.flush()
    sys.stderr.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
