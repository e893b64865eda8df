"""Kernel options as the command line gives them, for tests of ``options.resolve``."""

from __future__ import annotations

import argparse

from dist_kernel import options


def ns(**kw: object) -> argparse.Namespace:
    """The parsed namespace of ``--name value`` for each keyword (``ranks_per_node`` -> ``--ranks-per-node``)."""
    p = argparse.ArgumentParser()
    options.add_arguments(p)
    args: list[str] = []
    for k, v in kw.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    return p.parse_args(args)
