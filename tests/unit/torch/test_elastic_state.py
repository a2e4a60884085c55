"""hvd.elastic for torch: TorchState's save/restore/sync, ObjectState, and ElasticSampler.

Most tests run hora as a world of one in this process; the last one starts two real ranks and
checks that ``sync()`` gives rank 1 exactly rank 0's model, optimizer state, sampler and values.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hora.torch as hvd
from harness import run_ranks
from hora.torch.elastic import ElasticSampler, ObjectState, TorchState


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    hvd.init()
    yield
    hvd.shutdown()


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)
    )


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        F.mse_loss(model(x), y).backward()
        opt.step()


def snapshot(state: TorchState) -> dict[str, Any]:
    return copy.deepcopy({"model": state.model.state_dict(), "opt": state.optimizer.state_dict()})


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_exports_and_hvd_elastic():
    assert hvd.elastic.TorchState is TorchState
    for name in ["run", "State", "ObjectState", "ElasticSampler", "HostsUpdatedInterrupt"]:
        assert hasattr(hvd.elastic, name)
    assert hvd.elastic.HorovodInternalError is hvd.HorovodInternalError


def test_restore_goes_back_to_the_last_commit_again_and_again():
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, 2)
    state = TorchState(model, opt, epoch=3, batch=7, history=[1.0])
    assert state.model is model and state.optimizer is opt and state.epoch == 3
    state.commit()
    saved = snapshot(state)
    for _ in range(2):  # the saved copy must survive training after a restore
        train(model, opt, 3, seed=1)
        state.epoch, state.batch = 4, 0
        state.history.append(2.0)
        state.restore()
        assert_same(snapshot(state), saved)
        assert (state.epoch, state.batch, state.history) == (3, 7, [1.0])


def test_restore_brings_back_adam_state_and_lr():
    model = make_model(1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = TorchState(model=model, optimizer=opt)
    state.save()  # no state yet
    train(model, opt, 2)
    opt.param_groups[0]["lr"] = 0.5
    state.restore()
    assert opt.state_dict()["state"] == {}
    assert opt.param_groups[0]["lr"] == 0.01


def test_restore_drops_in_flight_reductions_of_a_distributed_optimizer():
    model = make_model(2)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    state = TorchState(model, opt)
    F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 2)).backward()  # reductions started
    with pytest.raises(AssertionError, match="pending"):
        opt.zero_grad()
    state.restore()
    assert not opt._handles and opt._synchronized is False
    opt.zero_grad()
    train(model, opt, 2)  # and training goes on


def test_sync_in_a_world_of_one_keeps_values_and_saves_them():
    model = make_model(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TorchState(model, opt, epoch=0)
    train(model, opt, 1)
    state.epoch = 5
    state.sync()
    synced = snapshot(state)
    train(model, opt, 2)
    state.epoch = 6
    state.restore()
    assert_same(snapshot(state), synced)
    assert state.epoch == 5


def test_assigning_a_new_model_keeps_the_new_one_and_none_is_a_plain_value():
    state = TorchState(optimizer=None, epoch=0)
    assert state.model is None and state.optimizer is None
    first = make_model(4)
    state = TorchState(first)
    second = make_model(5)
    state.model = second
    want = copy.deepcopy(second.state_dict())
    with torch.no_grad():
        for p in second.parameters():
            p.add_(1.0)
    state.restore()
    assert state.model is second
    assert_same(second.state_dict(), want)


def test_sampler_is_saved_restored_and_reset_before_the_callbacks():
    sampler = ElasticSampler(range(20), seed=1)
    calls = []
    state = TorchState(sampler=sampler, epoch=0)
    state.register_reset_callbacks([lambda: calls.append((sampler.num_replicas, sampler.rank))])
    sampler.set_epoch(1)
    list(sampler)
    for i in range(2):  # one record_batch per batch, as Horovod counts them
        sampler.record_batch(i, 4)
    state.commit()
    for i in range(2, 4):
        sampler.record_batch(i, 4)
    assert sampler.state_dict() == {"epoch": 1, "processed_num": 16}
    state.restore()
    assert sampler.state_dict() == {"epoch": 1, "processed_num": 8}
    assert len(sampler) == 12
    sampler.num_replicas, sampler.rank = 4, 3  # as if the world had changed: reset re-reads it
    state.on_reset()
    assert calls == [(1, 0)]


def test_object_state_save_restore_sync():
    state = ObjectState(hvd.broadcast_object, hvd.rank, epoch=1, seen=[1])
    state.seen.append(2)
    state.save()
    state.seen.append(3)
    state.epoch = 2
    state.restore()
    assert (state.epoch, state.seen) == (1, [1, 2])
    state.sync()
    assert (state.epoch, state.seen) == (1, [1, 2])


def test_run_syncs_then_calls_and_raises_outside_an_elastic_job():
    state = TorchState(make_model(6), epoch=2)
    seen = []

    @hvd.elastic.run
    def fn(state: TorchState, extra: int) -> int:
        seen.append(state.epoch)
        return state.epoch + extra

    assert fn(state, 1) == 3 and seen == [2]

    @hvd.elastic.run
    def failing(state: TorchState) -> None:
        raise hvd.HorovodInternalError("a peer died")

    with pytest.raises(hvd.HorovodInternalError):
        failing(state)


def test_elastic_sampler_follows_the_world_and_reshards_the_rest():
    assert (ElasticSampler(range(10)).num_replicas, ElasticSampler(range(10)).rank) == (1, 0)
    n, bs = 30, 2
    two = [ElasticSampler(range(n), seed=4, num_replicas=2, rank=r) for r in range(2)]
    consumed = set()
    for s in two:
        s.set_epoch(1)
        consumed.update(list(s)[: 3 * bs])
        for i in range(3):  # three batches done
            s.record_batch(i, bs)
    state = two[0].state_dict()
    assert state == {"epoch": 1, "processed_num": 3 * bs * 2}
    three = [ElasticSampler(range(n), seed=4, num_replicas=3, rank=r) for r in range(3)]
    for s in three:
        s.load_state_dict(state)
    rest = [list(s) for s in three]
    assert [len(r) for r in rest] == [6, 6, 6] == [len(s) for s in three]
    assert set(sum(rest, [])) == set(range(n)) - consumed
    again = ElasticSampler(range(n), seed=4, num_replicas=3, rank=1)
    again.load_state_dict(three[1].state_dict())
    assert list(again) == rest[1]
    three[0].set_epoch(2)
    assert three[0].state_dict() == {"epoch": 2, "processed_num": 0} and len(three[0]) == 10


def sync_on_two_ranks(rank: int) -> dict[str, Any]:
    import hora.torch as hvd
    from hora.torch.elastic import ElasticSampler, TorchState

    torch.set_num_threads(1)
    hvd.init()
    model = make_model(rank)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.5 + 0.1 * rank)
    train(model, sgd, rank + 1, seed=rank)  # locally: every rank differs
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    sampler = ElasticSampler(range(40), seed=3)
    sampler.set_epoch(rank + 1)
    list(sampler)
    sampler.record_batch(rank, 2)
    state = TorchState(model, opt, sampler=sampler, epoch=10 + rank, tags={"rank": rank})
    state.sync()
    out: dict[str, Any] = {
        "model": copy.deepcopy(model.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()),
        "values": (state.epoch, state.tags, sampler.state_dict()),
        "shard": list(sampler),
    }
    with torch.no_grad():  # a restore goes back to the synced values
        next(model.parameters()).add_(1.0)
    state.epoch = -1
    state.restore()
    out["restored"] = (copy.deepcopy(model.state_dict()), state.epoch)
    model.train()
    train(model, opt, 1, seed=100 + rank)  # one step together: the ranks stay equal
    out["after_step"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_sync_gives_rank_1_rank_0s_state():
    r0, r1 = run_ranks(sync_on_two_ranks, 2, timeout=90)
    for key in ["model", "opt", "values", "after_step"]:
        assert_same(r1[key], r0[key])
    assert r0["values"] == (10, {"rank": 0}, {"epoch": 1, "processed_num": 4})
    assert r0["opt"]["param_groups"][0]["lr"] == pytest.approx(0.1)
    assert set(r0["shard"]).isdisjoint(r1["shard"]) and len(r0["shard"]) == 18
    for r in (r0, r1):
        assert_same(r["restored"][0], r0["model"])
        assert r["restored"][1] == 10


def test_a_state_subclass_overriding_reset_has_it_called_on_every_reset():
    """Horovod's State.on_reset calls reset() (then the callbacks) after every reset."""
    calls: list[str] = []

    class Counting(ObjectState):
        def reset(self) -> None:
            calls.append("reset")

    state = Counting(hvd.broadcast_object, hvd.rank, epoch=0)
    state.register_reset_callbacks([lambda: calls.append("callback")])
    state.on_reset()
    state.on_reset()
    assert calls == ["reset", "callback", "reset", "callback"]

    class Torchy(TorchState):
        def reset(self) -> None:
            calls.append("torch reset")

    calls.clear()
    Torchy(model=make_model(0)).on_reset()
    assert calls == ["torch reset"]


def test_handlers_written_as_horovod_writes_them_work_with_torch_state():
    """A handler built with one argument (``handler_cls(value)``) that keeps its own copy, in
    the registry returned by get_handler_registry, as horovod/torch/elastic/state.py does."""
    from hora.torch.elastic import state as elastic_state

    class Counter:
        def __init__(self) -> None:
            self.n = 0

    class CounterHandler(elastic_state.StateHandler):
        def __init__(self, value: Counter) -> None:
            super().__init__(value)
            self._saved = value.n

        def save(self) -> None:
            self._saved = self.value.n

        def restore(self) -> None:
            self.value.n = self._saved

        def sync(self) -> None:
            self.value.n = hvd.broadcast_object(self.value.n, 0)

    class PlainHandler:  # not even a StateHandler subclass: save/restore/sync/set_value only
        def __init__(self, value: list) -> None:
            self.value = value
            self._saved = list(value)

        def save(self) -> None:
            self._saved = list(self.value)

        def restore(self) -> None:
            self.value[:] = self._saved

        def sync(self) -> None:
            pass

        def set_value(self, value: list) -> None:
            self.value = value
            self.save()

    registry = elastic_state.get_handler_registry()
    saved = list(registry)
    try:
        elastic_state.set_handler_registry([(Counter, CounterHandler), (list, PlainHandler),
                                            *saved])  # fmt: skip
        model = make_model(0)
        state = TorchState(model=model, counter=Counter(), items=[1], epoch=0)
        assert isinstance(state._handlers["counter"], CounterHandler)
        assert isinstance(state._handlers["model"], elastic_state.ModelStateHandler)
        state.counter.n, state.items[0] = 5, 2
        state.commit()
        state.counter.n, state.items[0] = 9, 7
        state.restore()
        assert (state.counter.n, state.items) == (5, [2])
        state.sync()
        state.on_reset()  # the handlers have no on_reset: nothing to call, nothing fails
        scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), 0.1), 1)
        with_scheduler = TorchState(model=model, scheduler=scheduler)
        assert isinstance(
            with_scheduler._handlers["scheduler"], elastic_state.LRSchedulerStateHandler
        )
    finally:
        elastic_state.set_handler_registry(saved)
