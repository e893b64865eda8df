"""``%dist_sync`` inside a rank, as a specification of what travels how: tensors, numpy arrays
and plain data as tensors and JSON, modules and optimizers as their state_dict, and nothing
pickled (no kernel: the rank side's pure decisions, with torch; the copy over a real group is in
test_respawn.py)."""

from __future__ import annotations

import json

import numpy as np
import torch

from dist_kernel.rank.sync import flatten, kind_of, plan, tensor_specs, unflatten


def round_trip(value):
    tensors: list = []
    tree = json.loads(json.dumps(flatten(value, tensors)))  # what crosses the wire: JSON and tensors
    assert [s["shape"] for s in tensor_specs(tree)] == [list(t.shape) for t in tensors]
    return unflatten(tree, [t.clone() for t in tensors])


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
