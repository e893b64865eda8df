"""Command line: ``python -m dist_kernel {kernel,install,run,clean,lab}``.

- ``kernel -f FILE [options]``: the parent kernel (what kernel.json runs);
- ``install [--user|--sys-prefix|--prefix P] [--name N] [--display-name T] [options]``:
  write a kernelspec bound to this interpreter;
- ``run NOTEBOOK [--output OUT] [options]``: execute a notebook distributed, exit 1 naming
  the cell and rank when a cell fails; each cell's output is shown as it arrives;
- ``clean``: end the processes left by kernels of this user that have exited, and remove
  their runtime directories (live kernels are never touched);
- ``lab [jupyter lab options]``: JupyterLab whose running cells keep their output while no page
  is open (:mod:`dist_kernel.lab.launch`; needs ``pip install "dist-kernel[lab]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from dist_kernel import options as cfgmod
from dist_kernel.exceptions import ConfigError
from dist_kernel.kernelspec import DEFAULT_DISPLAY_NAME, DEFAULT_NAME, kernel_json


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dist_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kernel", help="run the parent kernel (used by kernel.json)")
    k.add_argument("-f", dest="connection_file", required=True)
    cfgmod.add_arguments(k)

    i = sub.add_parser("install", help="install the kernelspec for this interpreter")
    where = i.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user")
    where.add_argument("--sys-prefix", action="store_true", help="install into sys.prefix (venv/conda)")
    where.add_argument("--prefix", default=None, help="install under this prefix")
    i.add_argument("--name", default=DEFAULT_NAME)
    i.add_argument("--display-name", default=None)
    cfgmod.add_arguments(i)

    r = sub.add_parser("run", help="execute a notebook on N ranks")
    r.add_argument("notebook")
    r.add_argument("--output", "-o", default=None, help="where to save the executed notebook")
    r.add_argument("--cell-timeout", type=float, default=None, help="seconds per cell (default: none)")
    cfgmod.add_arguments(r)

    sub.add_parser("clean", help="end what exited kernels left behind (safe any time)",
                   description="End the processes of this user's exited kernels (ranks, what they "
                   "started, even after os.setsid) and remove their runtime directories. "
                   "Live kernels and other users' processes are never touched.")

    sub.add_parser("lab", help="JupyterLab whose running cells keep their output while no page is open",
                   description="Start JupyterLab with server-side execution: a cell's output is written into "
                   "the server's copy of the notebook and saved, while a page is open or not. Every option is "
                   "passed to jupyter lab. Needs: pip install \"dist-kernel[lab]\"", add_help=False)
    return p


def cmd_kernel(ns: argparse.Namespace) -> int:
    try:
        config: cfgmod.KernelConfig | ConfigError = cfgmod.resolve(ns)
    except ConfigError as e:
        # start anyway: the frontend gets a kernel that explains the problem in the first
        # cell, instead of one that dies and restarts forever
        config = e
    from dist_kernel.parent.app import launch

    # arguments the frontend adds (nbclient's --HistoryManager.hist_file=:memory:, say) are
    # ipykernel options: the parent takes them, and so does every rank
    launch(ns.connection_file, config, ns.extra_argv)
    return 0


def cmd_install(ns: argparse.Namespace) -> int:
    from jupyter_client.kernelspec import KernelSpecManager

    try:
        cfgmod.resolve(ns)  # fail now, not at the first cell
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    options = cfgmod.option_argv(ns)
    display = ns.display_name or DEFAULT_DISPLAY_NAME
    with tempfile.TemporaryDirectory() as tmp:
        spec_dir = Path(tmp) / ns.name
        spec_dir.mkdir()
        (spec_dir / "kernel.json").write_text(json.dumps(kernel_json(options, display), indent=2) + "\n")
        dest = KernelSpecManager().install_kernel_spec(
            str(spec_dir), kernel_name=ns.name, user=ns.user,
            prefix=sys.prefix if ns.sys_prefix else ns.prefix)
    print(f"Installed kernelspec {ns.name!r} ({display}) in {dest}")
    return 0


def cmd_run(ns: argparse.Namespace) -> int:
    from dist_kernel.runner import run_notebook

    try:
        cfgmod.resolve(ns)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_notebook(ns.notebook, cfgmod.option_argv(ns), output=ns.output, cell_timeout=ns.cell_timeout)


def cmd_clean(ns: argparse.Namespace) -> int:
    from dist_kernel.cleanup import sweep
    from dist_kernel.parent.launch.node_starters import end_launch

    report = sweep(end_launch=end_launch)  # what a node starter started is ended by its kind
    for p in report.killed:
        print(f"ended {p.describe()}")
    for d in report.removed:
        print(f"removed {d}")
    for words in report.released:
        print(words)
    if not report.killed and not report.removed and not report.released:
        print("nothing to clean")
    return 0


def cmd_lab(argv: list[str]) -> int:
    from dist_kernel.lab.launch import run

    return run(argv)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["lab"]:  # every word after it is jupyter lab's, as given (its --help too)
        return cmd_lab(args[1:])
    parser = _parser()
    ns, extra = parser.parse_known_args(args)
    if extra and ns.command != "kernel":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    ns.extra_argv = extra
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    commands = {"kernel": cmd_kernel, "install": cmd_install, "run": cmd_run, "clean": cmd_clean}
    return commands[ns.command](ns)
