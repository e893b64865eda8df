"""``python -m dist_kernel run --output``: the notebook is written whole or not at all (issue 35,
item 6; that a killed run keeps its cells is in tests/kernel/test_notebooks.py)."""

from __future__ import annotations

import os
import stat

import nbformat
import pytest

from dist_kernel import runner


def test_the_output_notebook_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    out = tmp_path / "out.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    runner.write_atomically(nb, str(out))
    os.chmod(out, 0o640)
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="cell 1 ran\n")]
    runner.write_atomically(nb, str(out))
    assert nbformat.read(out, as_version=4).cells[0].outputs[0].text == "cell 1 ran\n"
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o640  # the mode it had

    def killed_mid_write(node, path, **kw):
        with open(path, "w") as f:
            f.write('{"cells": [')  # half a notebook, then the process is gone
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.nbformat, "write", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        runner.write_atomically(nb, str(out))
    assert nbformat.read(out, as_version=4).cells[0].outputs[0].text == "cell 1 ran\n"  # still the last whole one
    assert os.listdir(tmp_path) == ["out.ipynb"]  # no temporary file left
