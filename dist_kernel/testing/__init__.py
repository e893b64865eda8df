"""Stand-ins for ranks, so the real parent can be run with hundreds of them (issue 26).

Nothing here is used by the kernel itself: the parent reaches it only by name, through
``--launcher stub`` (:mod:`dist_kernel.parent.launch.node_starters.stub` starts
``python -m dist_kernel.testing.stub_node`` for each node, as ssh would start
``python -m dist_kernel.node``). Tests (``tests/kernel/test_many_ranks.py``) and benchmarks
(``benchmarks/sim_scale.py``) import it.

- :mod:`.cells`: the tiny cell language a stub rank runs (``print(rank)``, ``sleep(0.5)``,
  ``fail_on(3)``, ``die_on(7)``); no Python is executed.
- :mod:`.stub_rank`: one stub rank: the Jupyter messages of a real rank (signed with its own
  HMAC key, ``execute_reply`` with its IOPub count, ``dist_reply`` to every typed request).
- :mod:`.stub_node`: a stub node agent: the real agent's wire to the parent (CurveZMQ, signed
  control events, beats), hosting its node's stub ranks in one process.

A stub rank imports neither torch nor IPython, and costs one object in its node's process,
so 1,024 ranks (16 nodes of 64) fit on a 2-core machine.
"""
