"""``python -m dist_kernel.rank -f CONNECTION_FILE``: one rank (what the parent launches)."""

from dist_kernel.rank.kernel import main

main()
