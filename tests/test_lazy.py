"""The lazy CPU snapshot and the buffer allocated off the training thread (one process).

An optimizer's parameters and state are copied on the snapshot thread while forward and backward
run; the optimizer's step pre-hook waits for that copy. The snapshot thread is slowed down here
(a sleep before its real work) so that the training thread surely gets to the step first.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import mpickpt
from mpickpt.save import snapshot


@pytest.fixture(autouse=True)
def lazy_at_any_size(monkeypatch, request):
    """The states here are small: take the lazy path all the same (below LAZY_MIN bytes the
    snapshot is taken on the spot; ``test_a_small_state_is_taken_on_the_spot`` checks that)."""
    if "on_the_spot" not in request.node.name:
        monkeypatch.setattr(snapshot, "LAZY_MIN", 0)


@pytest.fixture
def slow_copy(monkeypatch):
    """Delay the snapshot thread's part by ``delay[0]`` seconds; ``finished`` lists when each
    one ended."""
    real = snapshot.Snapshotter._fill
    delay, finished = [1.0], []

    def slow(self, *a, **kw):
        time.sleep(delay[0])
        real(self, *a, **kw)
        finished.append(time.perf_counter())

    monkeypatch.setattr(snapshot.Snapshotter, "_fill", slow)
    return delay, finished


def model_and_adam(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64),
                                torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train_step(model, opt)  # Adam's state exists
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(16, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out.update({f"opt.{i}.{k}": v.clone() for k, v in st.items()})
    return out


def test_the_step_waits_for_the_lazy_copy_and_the_checkpoint_has_the_values_of_save(
        tmp_path, slow_copy):
    delay, finished = slow_copy
    model, opt = model_and_adam()
    saved = values(model, opt)
    with mpickpt.Checkpointer(tmp_path) as ck:
        t0 = time.perf_counter()
        handle = ck.save(1, {"model": model, "optim": opt})
        returned = time.perf_counter()
        assert returned - t0 < delay[0] / 2, "save() waited for the copy"
        model(torch.randn(16, 64)).square().mean().backward()  # runs beside the copy
        assert not finished
        opt.step()  # its pre-hook waits for the copy
        stepped = time.perf_counter()
        assert finished and finished[0] <= stepped
        assert handle.wait().committed
        after = values(model, opt)
        assert any(not torch.equal(after[k], saved[k]) for k in saved)  # the step changed them
        delay[0] = 0.0
        fresh_model, fresh_opt = model_and_adam(seed=1)
        assert ck.restore({"model": fresh_model, "optim": fresh_opt}) == 1
    got = values(fresh_model, fresh_opt)
    for k, v in saved.items():
        assert torch.equal(got[k], v), k


def test_a_tensor_reshaped_in_place_after_save_is_saved_with_the_shape_it_had(tmp_path,
                                                                              slow_copy):
    """The snapshot thread lays the host buffer out while the loop runs: a tensor the loop
    reshapes in place (unsqueeze_) meanwhile must keep, in this checkpoint and the next, the
    shape it had at save() (d0c89d8 stopped detaching plain tensors, and the new shape went into
    every later checkpoint)."""
    model, opt = model_and_adam()
    t = torch.arange(1000.0)
    with mpickpt.Checkpointer(tmp_path) as ck:
        h = ck.save(1, {"model": model, "optim": opt, "t": t})
        t.unsqueeze_(0)  # in place, while the snapshot thread sleeps
        assert h.wait().committed
        t.squeeze_(0)
        slow_copy[0][0] = 0.0
        assert ck.save(2, {"model": model, "optim": opt, "t": t}).wait().committed
        for step in (1, 2):
            fresh_model, fresh_opt = model_and_adam(seed=1)
            fresh = {"model": fresh_model, "optim": fresh_opt, "t": torch.zeros(1000)}
            assert ck.restore(fresh, step=step) == step
            assert torch.equal(fresh["t"], torch.arange(1000.0)), step


def test_buffers_and_tensors_no_optimizer_owns_are_copied_at_once(tmp_path, slow_copy):
    model, opt = model_and_adam()
    counter = torch.zeros(4)
    bn_mean = model[1].running_mean.clone()
    with mpickpt.Checkpointer(tmp_path) as ck:
        h = ck.save(1, {"model": model, "optim": opt, "counter": counter})
        model(torch.randn(16, 64))  # a training forward pass moves the running statistics
        counter.add_(7)
        assert not torch.equal(model[1].running_mean, bn_mean)
        assert h.wait().committed
        slow_copy[0][0] = 0.0
        fresh_model, fresh_opt = model_and_adam(seed=1)
        fresh = {"model": fresh_model, "optim": fresh_opt, "counter": torch.ones(4)}
        assert ck.restore(fresh) == 1
    assert torch.equal(fresh_model[1].running_mean, bn_mean)
    assert torch.equal(fresh["counter"], torch.zeros(4))


def test_wait_snapshot_waits_for_the_lazy_copy(tmp_path, slow_copy):
    _, finished = slow_copy
    model, opt = model_and_adam()
    before = model[0].weight.detach().clone()
    with mpickpt.Checkpointer(tmp_path) as ck:
        h = ck.save(1, {"model": model, "optim": opt})
        assert not finished
        ck.wait_snapshot()
        assert finished
        with torch.no_grad():
            model[0].weight.add_(1)  # not through the optimizer: allowed after wait_snapshot
        assert h.wait().committed
        slow_copy[0][0] = 0.0
        fresh_model, fresh_opt = model_and_adam(seed=1)
        ck.restore({"model": fresh_model, "optim": fresh_opt})
    assert torch.equal(fresh_model[0].weight, before)


def test_the_first_buffer_is_allocated_off_the_training_thread(tmp_path, allocations):
    model, opt = model_and_adam()
    with mpickpt.Checkpointer(tmp_path) as ck:
        assert ck.save(1, {"model": model, "optim": opt}).wait().committed
        assert ck.pinned_bytes > 0
        assert ck.save(2, {"model": model, "optim": opt}).wait().committed
    assert len(allocations) == 1 and allocations[0].startswith("mpickpt-snapshot"), allocations


def test_prepare_allocates_before_the_loop_and_the_first_save_reuses_it(tmp_path, allocations):
    model, opt = model_and_adam()
    state = {"model": model, "optim": opt}
    saved = values(model, opt)
    with mpickpt.Checkpointer(tmp_path) as ck:
        ck.prepare(state)
        assert allocations == [threading.current_thread().name]
        assert ck.pinned_bytes > 0
        assert ck.save(1, state).wait().committed
        assert ck.save(2, state).wait().committed
        assert len(allocations) == 1, allocations  # no save allocated
        fresh_model, fresh_opt = model_and_adam(seed=1)
        assert ck.restore({"model": fresh_model, "optim": fresh_opt}) == 2
    got = values(fresh_model, fresh_opt)
    assert all(torch.equal(got[k], saved[k]) for k in saved)


def test_a_small_state_is_taken_on_the_spot(tmp_path, allocations):
    """Below LAZY_MIN bytes, waking the snapshot thread costs more than the copy: a tiny state
    saved every step is copied and its buffer allocated by save() itself."""
    model, opt = model_and_adam()
    with mpickpt.Checkpointer(tmp_path) as ck:
        h = ck.save(1, {"model": model, "optim": opt})
        assert ck._capture.snapshotter._reading is None
        assert h.wait().committed
    assert allocations == [threading.main_thread().name]


def test_a_large_state_no_optimizer_owns_gets_its_buffer_on_the_spot(tmp_path, allocations):
    """Copied at once, it needs the buffer at once (rather than a temporary copy of it all)."""
    state = {"w": torch.ones((snapshot.CLONE_MAX >> 2) + 1024)}
    with mpickpt.Checkpointer(tmp_path) as ck:
        assert ck.save(1, state).wait().committed
    assert allocations == [threading.main_thread().name]


def test_a_deferred_buffer_holds_its_slot(tmp_path, slow_copy):
    """max_in_flight=1: a second save waits until the first one gave its buffer back, also when
    the first one's buffer was not allocated yet."""
    model, opt = model_and_adam()
    state = {"model": model, "optim": opt}
    with mpickpt.Checkpointer(tmp_path, snapshots=mpickpt.Snapshots(max_in_flight=1)) as ck:
        first = ck.save(1, state)
        second = ck.save(2, state)  # waits for the first one's (slow) copy and write
        assert second.wait().stats["waited_for_buffer_s"] > 0.5
        assert ck.pinned_bytes == first.wait().stats["snapshot_bytes"]


def test_a_failed_allocation_aborts_the_save_and_gives_the_slot_back(tmp_path, monkeypatch):
    model, opt = model_and_adam()
    real = snapshot.HostPool._new
    calls = []

    def failing(self, nbytes):
        calls.append(nbytes)
        if len(calls) == 1:
            raise MemoryError("no pinned memory left")
        return real(self, nbytes)

    monkeypatch.setattr(snapshot.HostPool, "_new", failing)
    with mpickpt.Checkpointer(tmp_path, snapshots=mpickpt.Snapshots(max_in_flight=1)) as ck:
        result = ck.save(1, {"model": model, "optim": opt}).wait()
        assert not result.committed and "no pinned memory left" in result.error
        train_step(model, opt)  # the step's pre-hook does not raise for the failed copy
        assert ck.save(2, {"model": model, "optim": opt}).wait(timeout=60).committed



def pretend_pinned(ck: mpickpt.Checkpointer, monkeypatch) -> None:
    """Make ``ck``'s pool claim to page-lock (as with CUDA) while allocating plain memory."""
    from mpickpt.save.pinned_pool import HostPool

    plain = HostPool(ck._pool.budget, pin=False)
    monkeypatch.setattr(ck._pool, "_new", plain._new)
    monkeypatch.setattr(ck._pool, "pin", True)


def test_a_cpu_state_page_locks_nothing_and_gives_no_prepare_hint(tmp_path, monkeypatch,
                                                                   caplog):
    """Only a snapshot copied straight from the GPU page-locks the pool (and then rank 0 says
    once that prepare() does it before the loop: tests/gpu); a CPU state never does, even
    where the pool could (as with CUDA), nor does prepare() for it."""
    from mpickpt.save import capture

    monkeypatch.setattr(capture, "HINT_BYTES", 1)
    caplog.set_level(logging.INFO, logger="mpickpt")
    model, opt = model_and_adam()
    state = {"model": model, "optim": opt}
    with mpickpt.Checkpointer(tmp_path) as ck:
        pretend_pinned(ck, monkeypatch)
        ck.prepare(state)
        assert ck.save(1, state).wait().committed
        assert ck.save(2, state).wait().committed
        assert ck._pool.allocated_bytes > 0 and ck._pool.locked_bytes == 0
    assert "Checkpointer.prepare(state)" not in caplog.text


@pytest.mark.quick
def test_the_owners_of_a_states_tensors_are_found_where_the_state_holds_them():
    """What the snapshot's hooks guard: the optimizers and modules a state holds (not those
    inside a module), each optimizer's parameters and state, each module's buffers (not its
    parameters: an optimizer not in the state may change those before the next forward pass);
    only an optimizer's CPU tensors may be copied lazily, by their size."""
    from mpickpt.format.state_tree import flatten_placed
    from mpickpt.save import owners

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    found: list = []
    flatten_placed({"a": [m, {"o": opt}], "sd": m.state_dict(), "n": 3}, owners=found)
    assert found == [m, opt]
    owned: dict[int, int] = {}
    guarded: set[int] = set()
    owners.owned_by(opt, owned, guarded)
    changed = [*m.parameters(), *(v for st in opt.state.values() for v in st.values())]
    assert guarded == {t.data_ptr() for t in changed}
    assert owned == {t.data_ptr(): t.numel() * t.element_size() for t in changed}
    bn = m[1]
    buffers = set(owners.buffer_ptrs(m))
    assert {bn.running_mean.data_ptr(), bn.running_var.data_ptr()} <= buffers
    assert not buffers & {p.data_ptr() for p in m.parameters()}
    assert not {bn.running_mean.data_ptr()} & guarded  # a forward changes it, not the step


def test_many_small_tensors_an_optimizer_owns_are_not_copied_on_the_spot(tmp_path, slow_copy):
    """Below LAZY_MIN bytes but of LAZY_COUNT tensors or more, the copy costs its tensors'
    count, not their bytes: an optimizer's are copied on the snapshot thread all the same, the
    step waits for them, and the checkpoint holds the values of save()."""
    delay, finished = slow_copy
    torch.manual_seed(0)
    layers = snapshot.LAZY_COUNT // 8 + 1  # a weight, a bias and their Adam state: 8 tensors
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    saved = values(model, opt)
    assert sum(t.nbytes for t in saved.values()) < snapshot.LAZY_MIN
    with mpickpt.Checkpointer(tmp_path) as ck:
        t0 = time.perf_counter()
        handle = ck.save(1, {"model": model, "optim": opt})
        assert time.perf_counter() - t0 < delay[0] / 2, "save() waited for the copy"
        assert ck._capture.snapshotter._reading is not None and not finished
        model(torch.randn(3, 2)).sum().backward()
        opt.step()  # its pre-hook waits for the copy
        assert finished
        assert handle.wait().committed
        delay[0] = 0.0
        fresh = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(layers)])
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
        assert ck.restore({"model": fresh, "optim": fresh_opt}) == 1
    got = values(fresh, fresh_opt)
    assert got.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(got[k], v), k
