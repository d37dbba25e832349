"""mpickpt.format.state_tree: flatten to JSON + tensors, and apply back in place."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mpickpt import RNGState
from mpickpt.errors import StateMismatchError, StateTreeError
from mpickpt.format import state_apply, state_tree
from mpickpt.format.entry import RankEntry
from mpickpt.format.manifest import Manifest


def roundtrip(saved: dict, into: dict) -> dict:
    tree, arrays = state_tree.flatten(saved)
    tree = json.loads(json.dumps(tree, allow_nan=False))  # it must survive strict JSON
    copies = {k: v.clone() for k, v in arrays.items()}
    state_apply.apply(tree, into, copies)
    return tree


def test_tree_is_strict_json_and_names_tensors_by_key_path():
    tree, arrays = state_tree.flatten({"a": {"b/c": torch.ones(2), 3: torch.zeros(1)},
                                       "f": float("nan"), ".": torch.ones(1)})
    json.dumps(tree, allow_nan=False)
    assert set(arrays) == {"a/b%2Fc", "a/3", "%%2E"}


def test_key_collisions_get_distinct_names():
    _, arrays = state_tree.flatten({"k": {0: torch.ones(1), "0": torch.zeros(1)}})
    assert sorted(arrays) == ["k/0", "k/0~1"]


def test_tensors_restore_in_place_and_scalars_by_assignment():
    live_t = torch.zeros(3)
    live = {"t": live_t, "n": 0, "s": "old", "tup": (0, 0), "l": [1, 2]}
    roundtrip({"t": torch.arange(3.0), "n": 5, "s": "new", "tup": (1, 2), "l": [3, 4]}, live)
    assert live["t"] is live_t and torch.equal(live_t, torch.arange(3.0))
    assert live == {"t": live_t, "n": 5, "s": "new", "tup": (1, 2), "l": [3, 4]}


def test_int_dict_keys_survive():
    live = {"d": {}}
    roundtrip({"d": {1: "a", 2.5: "b", None: "c", False: "d"}}, live)
    assert live["d"] == {1: "a", 2.5: "b", None: "c", False: "d"}


def test_module_optimizer_and_scheduler_restore():
    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Linear(4, 2)
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return {"m": m, "o": o, "s": torch.optim.lr_scheduler.StepLR(o, 1)}

    a, b = make(0), make(1)
    a["m"](torch.ones(1, 4)).sum().backward()
    a["o"].step()
    a["s"].step()
    roundtrip(a, b)
    assert torch.equal(a["m"].weight, b["m"].weight)
    assert b["o"].state_dict()["param_groups"][0]["lr"] == pytest.approx(0.01)
    ma = a["o"].state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(ma, b["o"].state_dict()["state"][0]["momentum_buffer"])


@pytest.mark.quick
def test_arrays_the_state_lacks_go_onto_the_device_named_and_kept_ones_are_not_copied():
    """A restore's arrays live in a reused buffer (``borrowed``): one the state does not hold
    yet is copied out, onto the device ``onto`` names for it (here the meta device, which any
    machine has), or kept as it is where ``keep`` names it (memory of its own); the saved
    tree says which device each tensor came from."""
    tree, arrays = state_tree.flatten({"a": torch.arange(4.0), "b": torch.ones(3),
                                       "c": torch.zeros(2), "g": torch.Generator()})
    assert state_apply.arrays_of(tree) == {"a": "cpu", "b": "cpu", "c": "cpu", "g": ""}
    live: dict = {}
    state_apply.apply(tree, live, arrays, borrowed=True, keep={"b"},
                     onto={"a": torch.device("meta"), "b": torch.device("cpu")})
    assert live["a"].device.type == "meta" and live["a"].shape == (4,)
    assert live["b"] is arrays["b"]  # kept: already on its device, in memory of its own
    assert live["c"] is not arrays["c"] and torch.equal(live["c"], arrays["c"])
    assert live["c"].untyped_storage().data_ptr() != arrays["c"].untyped_storage().data_ptr()


def test_rng_state_restores_future_draws():
    rng = RNGState()
    saved = {"rng": rng}
    tree, arrays = state_tree.flatten(saved)
    arrays = {k: v.clone() for k, v in arrays.items()}
    expected = (torch.rand(3), np.random.rand(2))
    state_apply.apply(tree, {"rng": RNGState()}, arrays)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(2), expected[1])


def test_unsupported_object_names_the_key_path():
    with pytest.raises(StateTreeError, match=r"state\[model/weird\].*object"):
        state_tree.flatten({"model": {"weird": object()}})


def test_unsupported_key_type_is_refused():
    with pytest.raises(StateTreeError, match="dict key"):
        state_tree.flatten({"d": {(1, 2): 3}})


def test_sparse_tensor_is_refused():
    with pytest.raises(StateTreeError, match="layout"):
        state_tree.flatten({"s": torch.eye(2).to_sparse()})


def test_shape_mismatch_is_found_by_dry_run_before_anything_changes():
    tree, arrays = state_tree.flatten({"a": torch.ones(2), "b": torch.ones(3)})
    live = {"a": torch.zeros(2), "b": torch.zeros(4)}
    specs = {k: state_apply.ArraySpec("float32", tuple(v.shape)) for k, v in arrays.items()}
    with pytest.raises(StateMismatchError, match=r"state\[b\].*float32\[3\].*float32\[4\]"):
        state_apply.apply(tree, live, specs, dry_run=True)
    assert torch.equal(live["a"], torch.zeros(2))


@pytest.mark.parametrize("into", ["sgd", "two-groups", "fewer-params"])
def test_an_optimizer_that_does_not_fit_is_found_by_dry_run_before_the_model_changes(into):
    """An SGD took an Adam's state without a word, and another layout of parameter groups failed
    only in load_state_dict, once the model had been overwritten."""
    def make(seed, kind):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        groups = {"adam": m.parameters(), "two-groups": [{"params": m[0].parameters()},
                                                         {"params": m[1].parameters()}],
                  "fewer-params": m[0].parameters()}.get(kind, m.parameters())
        o = torch.optim.SGD(groups, lr=0.1) if kind == "sgd" else torch.optim.Adam(groups)
        return {"m": m, "o": o}

    a, b = make(0, "adam"), make(1, into)
    a["m"](torch.ones(1, 4)).sum().backward()
    a["o"].step()
    tree, arrays = state_tree.flatten(a)
    specs = {k: state_apply.ArraySpec("float32", tuple(v.shape)) if v.is_floating_point()
             else state_apply.ArraySpec(str(v.dtype).removeprefix("torch."), tuple(v.shape))
             for k, v in arrays.items()}
    before = b["m"][0].weight.detach().clone()
    why = ("checkpoint holds the state of a torch.optim.adam.Adam, the state has a "
           "torch.optim.sgd.SGD") if into == "sgd" else \
        r"checkpoint holds an optimizer with parameter groups of \[4\] parameters, the " \
        r"state's has " + (r"\[2, 2\]" if into == "two-groups" else r"\[2\]")
    with pytest.raises(StateMismatchError, match=r"state\[o\]: " + why):
        state_apply.apply(tree, b, specs, dry_run=True)
    assert torch.equal(b["m"][0].weight, before)
    c = make(2, "adam")  # the same class and layout: fits
    state_apply.apply(tree, c, specs, dry_run=True)
    state_apply.apply(tree, c, arrays)
    assert torch.equal(c["m"][0].weight, a["m"][0].weight)


@pytest.mark.parametrize("key", [float("inf"), float("nan"), "\udcff"])
def test_a_key_no_checkpoint_can_hold_is_refused_at_save_naming_its_path(key):
    """A non-finite float or a string that is not UTF-8 failed the save in the background, with
    no key named."""
    with pytest.raises(StateTreeError, match=r"state\[hist\]: dict key .* cannot be saved"):
        state_tree.flatten({"hist": {key: torch.ones(1)}})


def test_a_nested_tensor_is_refused_at_save_naming_its_path():
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(StateTreeError, match=r"state\[a/nt\]: nested tensor .* cannot be saved"):
        state_tree.flatten({"a": {"nt": nt}})


def test_numpy_scalars_that_are_python_floats_keep_their_numpy_type():
    """np.float64 subclasses float: it came back a Python float, without .dtype."""
    saved = {"f64": np.float64(0.1), "f32": np.float32(0.1), "s": np.str_("x"), "n": 3}
    tree, arrays = state_tree.flatten(saved)
    got = roundtrip_into({}, tree, arrays)
    assert type(got["f64"]) is np.float64 and got["f64"] == saved["f64"]
    assert type(got["f32"]) is np.float32 and got["s"] == "x" and got["n"] == 3


def test_restoring_into_an_expanded_view_is_refused_by_the_dry_run_naming_it():
    tree, arrays = state_tree.flatten({"a": torch.ones(3), "bias": torch.ones(3, 2)})
    live = {"a": torch.zeros(3), "bias": torch.zeros(2).expand(3, 2)}
    specs = {k: state_apply.ArraySpec("float32", tuple(v.shape)) for k, v in arrays.items()}
    with pytest.raises(StateMismatchError, match=r"state\[bias\]: the state's tensor is an "
                                                 "expanded view"):
        state_apply.apply(tree, live, specs, dry_run=True)
    assert torch.equal(live["a"], torch.zeros(3))


def roundtrip_into(into, tree, arrays):
    copies = {k: v.clone() for k, v in arrays.items()}
    return state_apply.apply(tree, into, copies)


def test_a_sequential_schedulers_last_lr_comes_back_as_it_was_saved():
    """A fresh SequentialLR shares one list with its first scheduler: restoring into the lists
    its state_dict() returned wrote the first scheduler's value over its own."""
    def make():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        lr = torch.optim.lr_scheduler
        return opt, lr.SequentialLR(opt, [lr.ConstantLR(opt, factor=0.5, total_iters=2),
                                          lr.ExponentialLR(opt, gamma=0.9)], milestones=[2])
    opt, sched = make()
    for _ in range(3):
        opt.step()
        sched.step()
    fresh_opt, fresh = make()
    roundtrip({"o": opt, "s": sched}, {"o": fresh_opt, "s": fresh})
    assert fresh.get_last_lr() == sched.get_last_lr() == [pytest.approx(0.09)]


def test_key_missing_from_checkpoint_is_a_mismatch():
    tree, arrays = state_tree.flatten({"a": 1})
    with pytest.raises(StateMismatchError, match="'extra'"):
        state_apply.apply(tree, {"a": 0, "extra": 2}, arrays, dry_run=True)


def test_malformed_tree_is_a_clear_error_not_a_crash():
    for bad in [{"type": "eval", "value": "1"}, {"nope": 1}, {"type": "dict", "items": 3},
                {"type": "int", "value": "x"}, {"type": "tensor", "name": "missing"}]:
        with pytest.raises(StateMismatchError):
            state_apply.apply({"type": "dict", "items": [["k", bad]]}, {"k": None}, {})


def test_a_state_nested_deeper_than_a_restore_accepts_is_refused_at_save():
    deep: dict = {}
    cur = deep
    for _ in range(state_tree.MAX_DEPTH + 1):
        cur["d"] = {}
        cur = cur["d"]
    with pytest.raises(StateTreeError, match="nested more than 64 levels deep"):
        state_tree.flatten(deep)
    ok: dict = {}
    cur = ok
    for _ in range(state_tree.MAX_DEPTH - 1):
        cur["d"] = {}
        cur = cur["d"]
    cur["t"] = torch.ones(1)
    tree, _ = state_tree.flatten(ok)
    m = Manifest(1, 1, "r", [RankEntry(0, "rank-00000.h5", 0, tree, [])])
    assert Manifest.from_json(m.to_json(), "here").ranks[0].tree == tree  # within the limit
