"""``python -m dist_kernel``: see :mod:`dist_kernel.cli`."""

from dist_kernel.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
