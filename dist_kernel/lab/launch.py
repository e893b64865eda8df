"""``python -m dist_kernel lab [jupyter lab options]``: JupyterLab whose running cells outlive the page.

JupyterLab as ``jupyter lab`` starts it, every option passed through, with this package's server
extension (:mod:`dist_kernel.lab`) added: cells run from the server (jupyter-server-nbmodel) into
the server's copy of the notebook, which is kept while a cell of it runs, with displays updated in
place saved at their latest frame and output recovery on. It says so in its first lines. Without
the ``lab`` extra it stops at once, naming the packages and the command that installs them.
"""

from __future__ import annotations

import importlib.util
import sys

#: the import name of each package the extra brings -> its name on PyPI
NEEDED = {"jupyterlab": "jupyterlab", "jupyter_server_nbmodel": "jupyter-server-nbmodel",
          "jupyter_server_ydoc": "jupyter-collaboration"}
INSTALL = 'pip install "dist-kernel[lab]"'
EXTENSION = "dist_kernel.lab"
CLEANUP_OPTION = "--YDocExtension.document_cleanup_delay"
#: jupyter-server-ydoc's default document_cleanup_delay (seconds)
DEFAULT_CLEANUP = "60"


def missing_packages() -> list[str]:
    """The PyPI names of the extra's packages this interpreter cannot import."""
    return [dist for module, dist in NEEDED.items() if importlib.util.find_spec(module) is None]


def cleanup_delay(argv: list[str]) -> str:
    """The document cleanup delay the options set (the last one wins, as in traitlets), in words."""
    value = DEFAULT_CLEANUP
    for i, arg in enumerate(argv):
        if arg.startswith(CLEANUP_OPTION + "="):
            value = arg.split("=", 1)[1]
        elif arg == CLEANUP_OPTION and i + 1 < len(argv):
            value = argv[i + 1]
    return "never" if value.strip().lower() == "none" else f"{value} s after"


def banner(argv: list[str]) -> str:
    """The first lines: where a running cell's output is kept."""
    after = cleanup_delay(argv)
    forgotten = "never forgotten" if after == "never" else f"forgotten {after} its last cell ended"
    return "\n".join([
        "dist_kernel lab: cells run from the server (jupyter-server-nbmodel), whether a page is open or not.",
        "  output of a running cell: written into the server's copy of the notebook and saved to its .ipynb file;",
        f"  a notebook with a running cell is kept while no page shows it ({forgotten} and its last page closed);",
        "  a reopened page shows the output so far and follows the running cell (output recovery: on);",
        "  progress bars and other displays updated in place are saved at their latest frame.",
        "",
    ])


def extension_args(argv: list[str]) -> list[str]:
    """``argv`` with this package's server extension enabled (after the user's own options)."""
    return [*argv, f"--ServerApp.jpserver_extensions={EXTENSION}=True"]


def run(argv: list[str]) -> int:
    missing = missing_packages()
    if missing:
        print(f"error: python -m dist_kernel lab needs JupyterLab with server-side execution; "
              f"not installed: {', '.join(missing)}. Install it with: {INSTALL}", file=sys.stderr)
        return 2
    print(banner(argv), flush=True)
    from jupyterlab.labapp import LabApp

    LabApp.launch_instance(argv=extension_args(argv))
    return 0
