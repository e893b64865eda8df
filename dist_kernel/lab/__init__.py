"""JupyterLab with server-side execution that keeps a running cell's output while no page is open.

``python -m dist_kernel lab`` (:mod:`dist_kernel.lab.launch`) starts JupyterLab with this package
as a Jupyter server extension: :mod:`dist_kernel.lab.nbmodel` puts its pieces into
jupyter-server-nbmodel and jupyter-server-ydoc when the server loads it. A JupyterLab started
otherwise gets them with ``--ServerApp.jpserver_extensions=dist_kernel.lab=True`` (or
``c.ServerApp.jpserver_extensions = {"dist_kernel.lab": True}`` in ``jupyter_server_config.py``).

Nothing here runs in a kernel: the parent and the ranks never import this package.
"""

from __future__ import annotations

from typing import Any


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "dist_kernel.lab"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from dist_kernel.lab.nbmodel import install

    missing = install()
    serverapp.log.info("dist_kernel.lab: %s", "server-side pieces in place" if not missing
                       else f"not in place: {', '.join(missing)} (see the warnings above)")
