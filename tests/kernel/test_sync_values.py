"""``%dist_sync`` inside a rank, as a specification of what travels how: tensors, numpy arrays
and plain data as tensors and JSON, modules and optimizers as their state_dict, and nothing
pickled (no kernel: the rank side's pure decisions, with torch; the copy over a real group is in
test_respawn.py and test_sync_hangs.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dist_kernel.rank.sync_values import flatten, kind_of, nbytes, plan, tensor_specs, typed, unflatten


def round_trip(value):
    tensors: list = []
    tree = json.loads(json.dumps(flatten(value, tensors)))  # what crosses the wire: JSON and bytes
    specs = tensor_specs(tree)
    assert [nbytes(s) for s in specs] == [t.numel() for t in tensors]
    assert all(t.dtype == torch.uint8 and t.is_contiguous() for t in tensors)  # ready to broadcast as they are
    return unflatten(tree, [typed(t.clone(), s) for t, s in zip(tensors, specs, strict=True)])


def test_an_optimizers_state_keeps_its_int_keys_tuples_and_tensors():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    back = round_trip(state)
    assert back["param_groups"][0]["betas"] == state["param_groups"][0]["betas"]
    assert isinstance(back["param_groups"][0]["betas"], tuple) and set(back["state"]) == {0, 1}
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    torch.optim.Adam(torch.nn.Linear(3, 2).parameters()).load_state_dict(back)  # it loads


def test_numpy_arrays_and_plain_data_travel_and_come_back_as_they_were():
    back = round_trip({"xs": np.arange(6.0).reshape(2, 3), "names": ["a", "b"], "lr": 0.1, "n": None})
    assert isinstance(back["xs"], np.ndarray) and back["xs"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert back["names"] == ["a", "b"] and back["lr"] == 0.1 and back["n"] is None


def held(*kinds: dict) -> list[dict]:
    return list(kinds)


def test_a_module_every_rank_built_takes_the_sources_state_dict():
    ns = {"model": torch.nn.Linear(3, 2)}
    p = plan("model", ns, held({"model": "module"}, {"model": "module"}), 0, [])
    assert p["mode"] == "state" and p["kind"] == "module"


def test_a_module_or_optimizer_a_rank_has_not_built_is_named_with_how_to_go_on():
    ns = {"model": torch.nn.Linear(3, 2)}
    p = plan("model", ns, held({"model": "module"}, {}, {"model": "module"}), 0, [])
    assert p["mode"] == "error" and "rank 1 has none: build it there first" in p["error"]


def test_what_is_neither_tensors_nor_plain_data_is_refused_and_never_pickled():
    class Mine:
        pass

    ns = {"gen": (i for i in range(3)), "box": {"x": Mine()}, "objs": np.array([object()])}
    two = held({}, {})
    assert plan("gen", ns, two, 0, [])["error"].startswith("a generator, which cannot be copied")
    assert plan("box", ns, two, 0, [])["error"].startswith("a dict holding a Mine, which cannot be copied")
    assert "numpy array of object" in plan("objs", ns, two, 0, [])["error"]
    assert plan("nowhere", ns, two, 1, [])["error"] == "not defined on rank 1"


def test_kinds_are_told_apart_by_what_can_load_a_state_dict():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert [kind_of(model), kind_of(opt), kind_of(torch.ones(1)), kind_of(3)] == ["module", "optimizer", "", ""]
    assert kind_of(torch.optim.lr_scheduler.StepLR(opt, 1)) == "StepLR"


@pytest.mark.parametrize("array", [np.arange(5)[::-1], np.arange(3, dtype=">f4"), np.arange(12.0).reshape(3, 4).T,
                                   np.arange(4, dtype=np.uint16), np.array([[True, False]]), np.array([1 + 2j])])
def test_a_numpy_view_or_a_foreign_byte_order_arrives_equal_in_this_machines_byte_order(array):
    back = round_trip({"a": array})["a"]
    assert isinstance(back, np.ndarray) and back.tolist() == array.tolist() and back.shape == array.shape
    assert back.dtype == array.dtype.newbyteorder("=")  # >f4 arrives as float32 (native), the values alike


def test_tensors_arrive_as_their_values_whatever_their_layout_dtype_or_view():
    t = torch.arange(12.0).reshape(3, 4)
    values = {"t": t.T, "neg": torch.tensor([1 + 2j]).conj(), "half": t.half()[::2], "u16": t.to(torch.uint16),
              "scalar": torch.tensor(3.5), "empty": torch.empty(0, 3), "bf": t.bfloat16()}
    back = round_trip(values)
    for name, value in values.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value.resolve_conj()), name


def test_a_sparse_coo_tensor_arrives_as_the_same_sparse_tensor():
    s = torch.eye(3).to_sparse()
    back = round_trip(s)
    assert back.layout == torch.sparse_coo and torch.equal(back.to_dense(), torch.eye(3))


def test_what_cannot_travel_is_refused_by_name_with_the_way_round_and_no_tensor_is_left_to_send():
    loop: list = [1]
    loop.append(loop)
    ns = {"meta": torch.empty(3, device="meta"), "csr": torch.eye(3).to_sparse_csr(), "loop": loop,
          "inner": {"k": [torch.ones(2), torch.empty(1, device="meta")]}}
    two = held({}, {})
    sent: list = []
    errors = {name: plan(name, ns, two, 0, sent) for name in ns}
    assert sent == []  # the ones among them that could be prepared were taken back with their name
    assert errors["meta"]["error"].startswith("a meta tensor, which cannot be copied: a tensor on the meta device "
                                              "has a shape but no data")
    assert errors["csr"]["error"].startswith("a sparse_csr tensor, which cannot be copied: only dense and sparse COO")
    assert errors["loop"]["error"].startswith("a list that holds itself, which cannot be copied: copy the data "
                                              "without the cycle")
    assert errors["inner"]["error"].startswith("a dict holding a meta tensor, which cannot be copied")


def test_a_state_dict_that_raises_is_that_names_failure_and_the_plan_never_raises():
    class Broken:
        def state_dict(self):
            raise RuntimeError("no state today")

        def load_state_dict(self, state):
            pass

    kind = kind_of(Broken())
    p = plan("b", {"b": Broken()}, held({"b": kind}, {"b": kind}), 0, [])
    assert p == {"mode": "error", "error": "it could not be prepared for copying: RuntimeError: no state today"}
