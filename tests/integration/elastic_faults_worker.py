"""The training script of tests/integration/test_elastic_faults.py (run by `hora run`).

It trains a 4-value "model" with plain NumPy on hora, one committed step at a time, and injects
one fault once, in one phase, in one worker (``victim``). argv[1] is a JSON object:

* ``phase``: ``start`` (before the first commit), ``step`` (between a step's allreduce and its
  commit), ``allreduce`` (while an allreduce is in flight), ``sync`` (inside the state broadcast
  after a reset), ``reform`` (inside the re-formation, after the worker got its new rank and
  before its connections exist). ``sync`` and ``reform`` first add ``127.0.0.1:2`` at step 2 so
  that a reset happens; the victim is then one of the new workers.
* ``fault``: ``exception``, ``sigkill``, ``sigterm``, ``hosts`` (write ``hosts_after`` to
  the discovery script's file: a host added or removed), or ``none``. ``victim`` ``*``: every
  worker faults.
* ``schedule`` (optional): ``{step: hosts}``, written to the discovery file at those steps;
  ``settle`` (default true): hold the training until the job took in the hosts written;
  ``late_start``: seconds the workers of 127.0.0.1 wait before ``hvd.init()``; ``linger``:
  seconds every worker waits after training; ``progress``: a file rank 0 appends
  ``step size`` to at every step; ``times``: a file rank 0 appends ``time step size`` to.
* ``swap`` (optional): ``{"step": s, "after_s": x, "hosts": final}``: at step ``s`` rank 0
  adds 127.0.0.1:2 to the discovery file, and ``x`` seconds later writes ``final`` (the first
  host removed); at 0 it writes ``final`` at once. The training then holds (committing) until
  its rank 0 runs on a host that ``final`` lists, for at most ``hold_s`` seconds (default 30).
* ``step_s``: seconds each step sleeps before its commit (default 0.1).
* ``early``: ``{"id": worker, "step": s}``: that worker returns from its training after step
  ``s`` (and reports DONE), the others train on.
* ``fail_after``: ``{"id": worker, "wait": x}``: after DONE, that worker waits ``x`` seconds
  and exits with 3.
* ``steps``; ``dir``: where the markers go (``fired`` once the fault fired, ``t_fault``).
* ``framework`` (optional): ``numpy`` (the default: NumPy on ``hora``); ``torch`` (a
  ``torch.nn.Linear`` under ``hora.torch``'s ``DistributedOptimizer`` and ``TorchState``);
  ``tf2`` (a ``tf.Variable`` trained by a ``tf.function`` step with
  ``hvd.DistributedGradientTape``, ``hora.tensorflow``'s ``TensorFlowState`` and
  ``hvd.elastic.run``); ``keras`` (tf_keras's ``model.fit`` under ``hora.tensorflow.keras``:
  ``KerasState``, a ``DistributedOptimizer`` and the elastic callbacks, committing at every
  batch; one batch per epoch); ``keras3`` (that worker under ``hora.keras``, Keras 3). The
  Keras workers make their callbacks once, and hold a pending host change before a batch until
  the launcher announced it (so that ``CommitStateCallback`` meets it). The same fault hooks
  and the same ledger in every one; torch and TensorFlow run on one thread (TensorFlow one each
  way).

At the end each worker prints ``DONE {json}``: its step, the committed-sample counter, the
history of committed (step, size) pairs, its parameters, and its reset count.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np

CFG = json.loads(sys.argv[1])
FRAMEWORK = CFG.get("framework", "numpy")
if FRAMEWORK == "numpy":
    import hora as hvd
    from hora.elastic import ObjectState as BaseState
    from hora.elastic import run
elif FRAMEWORK == "torch":
    import torch

    import hora.torch as hvd

    torch.set_num_threads(1)
    BaseState = hvd.elastic.TorchState
    run = hvd.elastic.run
else:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if FRAMEWORK == "keras":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras is tf_keras
    elif FRAMEWORK == "keras3":
        os.environ.pop("TF_USE_LEGACY_KERAS", None)  # tf.keras is Keras 3, hora.keras's
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if FRAMEWORK in ("keras", "keras3"):
        if FRAMEWORK == "keras":
            import hora.tensorflow.keras as hvd
        else:
            import hora.keras as hvd

        BaseState = hvd.elastic.KerasState
    else:
        import hora.tensorflow as hvd

        BaseState = hvd.elastic.TensorFlowState
    run = hvd.elastic.run
ME = os.environ["HORA_ELASTIC_ID"]
PHASE, FAULT, VICTIM, STEPS = CFG["phase"], CFG["fault"], CFG["victim"], CFG["steps"]
DIR = CFG["dir"]
BATCH, LR = 8, 0.01
resumed: list[float] = []  # when the first step after each reset completed


def _once(name: str) -> bool:
    """True for the first caller in the whole job (a marker file made exclusively)."""
    try:
        os.close(os.open(os.path.join(DIR, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def maybe_fault(phase: str) -> None:
    if phase != PHASE or FAULT == "none":
        return
    if VICTIM != "*" and (ME != VICTIM or not _once("fired")):
        return
    with open(os.path.join(DIR, "t_fault"), "w") as f:
        f.write(repr(time.time()))
    if FAULT == "exception":
        raise RuntimeError(f"injected fault in {ME} ({phase})")
    if FAULT == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    with open(CFG["hosts_file"], "w") as f:
        f.write(CFG["hosts_after"])


def maybe_add_host(step: int) -> None:
    """The sync and reform phases need a reset with new workers: add 127.0.0.1:2. A
    ``schedule`` ({step: hosts}) changes the hosts at those steps (rank 0, once each)."""
    hosts = CFG.get("schedule", {}).get(str(step))
    if hosts is not None and hvd.rank() == 0 and _once(f"schedule.{step}"):
        with open(CFG["hosts_file"], "w") as f:
            f.write(hosts)
    swap = CFG.get("swap")
    if swap and step == swap["step"] and hvd.rank() == 0 and _once("swap"):
        _swap(swap)
    if PHASE in ("sync", "reform") and step == 2 and ME == "localhost:0" and _once("added"):
        with open(CFG["hosts_file"], "w") as f:
            f.write("localhost:2\n127.0.0.1:2\n")


def _swap(swap: dict) -> None:
    """Add 127.0.0.1:2 now, and write the final hosts ``after_s`` seconds later (a daemon
    timer in this process, which trains on meanwhile)."""

    def write(text: str) -> None:
        with open(CFG["hosts_file"], "w") as f:
            f.write(text)
        with open(os.path.join(DIR, "t_hosts"), "a") as f:
            f.write(f"{time.time()!r} {text.split()}\n")

    if swap["after_s"] <= 0:
        write(swap["hosts"])
        return
    write(swap.get("both", "localhost:2\n127.0.0.1:2\n"))
    timer = threading.Timer(swap["after_s"], write, args=(swap["hosts"],))
    timer.daemon = True
    timer.start()


if PHASE == "reform":  # fault inside the re-formation: after the rank, before the connections
    from hora.core import runtime as _rt

    _init = _rt.Runtime.__init__

    def _reforming(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        maybe_fault("reform")
        _init(self, *args, **kwargs)

    _rt.Runtime.__init__ = _reforming  # type: ignore[method-assign]


def f_lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()


def _hosts_pending() -> bool:
    """Rank 0: a host change was written that the job has not taken in yet (hold the training
    until it has, so that a short job cannot end before discovery notices)."""
    if not CFG.get("settle", True):
        return False
    if CFG.get("swap"):  # until rank 0 runs on a host of the final list
        if not os.path.exists(os.path.join(DIR, "swap")):
            return False
        with open(CFG["hosts_file"]) as f:
            names = {line.rsplit(":", 1)[0] for line in f.read().split()}
        slots = sum(int(line.rsplit(":", 1)[1]) for line in f_lines(CFG["hosts_file"]))
        return ME.split("+")[0].rsplit(":", 1)[0] not in names or hvd.size() != slots
    fired = os.path.exists(os.path.join(DIR, "fired"))
    if FAULT not in ("hosts", "none") and fired and not CFG.get("schedule"):
        return False
    with open(CFG["hosts_file"]) as f:
        slots = sum(int(line.rsplit(":", 1)[1]) for line in f.read().split())
    return min(slots, CFG["max_np"]) != hvd.size()


def settle(state: BaseState) -> None:
    """Commit until the hosts written to the discovery file are the job's (at most
    ``hold_s``, 30 s by default)."""
    hold = CFG.get("hold_s", 30)
    deadline = time.monotonic() + hold
    while hvd.broadcast_object(hvd.rank() == 0 and _hosts_pending(), 0, name="pending"):
        if time.monotonic() > deadline:
            raise SystemExit(f"{ME}: the job did not take in the new hosts within {hold} s")
        time.sleep(CFG.get("step_s", 0.1))
        state.commit()


def await_announcement(state: BaseState) -> None:
    """Keras: hold before a batch (without committing) while a host change is pending and the
    launcher has not announced it yet, so that CommitStateCallback's commit is the one that
    raises HostsUpdatedInterrupt (at most ``hold_s``)."""
    from hora.elastic.state import host_updates

    hold = CFG.get("hold_s", 30)
    deadline = time.monotonic() + hold
    while hvd.broadcast_object(
        hvd.rank() == 0 and _hosts_pending() and host_updates()[0] <= state._seen_updates,
        0,
        name="announce",
    ):
        if time.monotonic() > deadline:
            raise SystemExit(f"{ME}: the launcher did not announce the new hosts within {hold} s")
        time.sleep(0.05)


class FaultyState(BaseState):
    def sync(self) -> None:
        maybe_fault("sync")
        super().sync()


# the worker environment is Horovod's from the start (before hvd.init), as the launcher plans it
_host, _index = ME.split("+")[0].rsplit(":", 1)
for _name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"):
    if not os.environ.get("HOROVOD_" + _name, "").isdigit():
        raise SystemExit(f"{ME}: HOROVOD_{_name} is not set at start")
if os.environ.get("HOROVOD_HOSTNAME") != _host or os.environ["HOROVOD_LOCAL_RANK"] != _index:
    raise SystemExit(f"{ME}: HOROVOD_HOSTNAME/HOROVOD_LOCAL_RANK do not name this slot")
if ME.startswith("127.0.0.1"):
    time.sleep(CFG.get("late_start", 0))  # a slow new host
hvd.init()
if FRAMEWORK == "numpy":
    state = FaultyState(
        hvd.broadcast_object, hvd.rank, step=0, samples=0, history=[], params=np.zeros(4)
    )
elif FRAMEWORK == "torch":
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    state = FaultyState(model=model, optimizer=optimizer, step=0, samples=0, history=[])
elif FRAMEWORK == "tf2":
    weights = tf.Variable(tf.zeros(4, tf.float64))
    state = FaultyState([weights], step=0, samples=0, history=[])
else:
    model = tf.keras.Sequential(
        [tf.keras.Input((4,)), tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(LR))
    # d(sum of outputs)/d(kernel) is the input: every step moves each weight by -LR
    model.compile(optimizer=optimizer, loss=lambda _, y: tf.reduce_sum(y))
    state = FaultyState(model, step=0, epoch=0, samples=0, history=[])
resets: list[int] = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])
if os.environ.get("HORA_SIZE") != str(hvd.size()) or os.environ.get("HOROVOD_HOSTNAME") is None:
    raise SystemExit(f"{ME}: the worker environment does not match hvd.size() {hvd.size()}")


def ledger(state: FaultyState, size: int) -> None:
    """The step is committed next: count it (and its size), then maybe fault."""
    if hvd.rank() == 0 and CFG.get("progress"):
        with open(CFG["progress"], "a") as f:
            f.write(f"{state.step} {hvd.size()}\n")
    if hvd.rank() == 0 and CFG.get("times"):
        with open(CFG["times"], "a") as f:
            f.write(f"{time.time()!r} {state.step} {hvd.size()}\n")
    if len(resumed) < len(resets):
        resumed.append(time.time())
    state.samples += BATCH * size
    state.step += 1
    state.history = [*state.history, (state.step, size)]
    if state.step == 4:
        maybe_fault("step")
    time.sleep(CFG.get("step_s", 0.1))


def after_commit(state: FaultyState) -> bool:
    """Hold for new hosts; whether this worker returns from its training here."""
    settle(state)
    early = CFG.get("early")
    return bool(early and early["id"] == ME and state.step == early["step"])


if FRAMEWORK == "tf2":

    @tf.function
    def tf_step(grad: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(weights * grad)  # its gradient is grad, averaged over ranks
        (averaged,) = hvd.DistributedGradientTape(tape).gradient(loss, [weights])
        weights.assign_sub(LR * averaged)
        return hvd.allreduce(tf.ones([1], tf.float64), op=hvd.Sum, name="size")


class Ledger(tf.keras.callbacks.Callback if FRAMEWORK.startswith("keras") else object):  # type: ignore
    """model.fit's hooks: a batch (one epoch) is a step; it is counted before the commit."""

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        maybe_add_host(state.step)
        await_announcement(state)

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        ledger(state, hvd.size())


if FRAMEWORK.startswith("keras"):  # made once and given to every fit, as in Horovod's examples
    callbacks = [Ledger(), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state)]  # fmt: skip


@run
def train(state: FaultyState) -> None:
    if state.step == 0:
        maybe_fault("start")
    if FRAMEWORK.startswith("keras"):
        x, y = np.ones((1, 4), np.float32), np.zeros((1, 1), np.float32)
        state.model.fit(x, y, batch_size=1, epochs=STEPS - state.step, verbose=0,
                        shuffle=False, callbacks=callbacks)  # fmt: skip
        return
    while state.step < STEPS:
        maybe_add_host(state.step)
        grad = np.array([state.step + 1, 1.0, 0.0, 0.0])
        if FRAMEWORK == "torch":
            optimizer.zero_grad()
            # the gradient of the sum of the outputs is the input: step + 1, averaged over ranks
            model(torch.full((1, 4), state.step + 1.0)).sum().backward()
            optimizer.step()
            size = int(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="size").item())
        elif FRAMEWORK == "tf2":
            size = int(tf_step(tf.constant([state.step + 1.0] * 4, tf.float64)).numpy()[0])
        elif state.step == 3 and PHASE == "allreduce":
            handle = hvd.allreduce_async(grad, op=hvd.Sum, name="grad")
            maybe_fault("allreduce")
            out = hvd.synchronize(handle)
        else:
            out = hvd.allreduce(grad, op=hvd.Sum, name="grad")
        if FRAMEWORK == "numpy":
            size = int(out[1])
            state.params = state.params - LR * out[0] / size  # every rank adds step + 1
        ledger(state, size)
        state.commit()
        if after_commit(state):
            return


train(state)
time.sleep(CFG.get("linger", 0))  # time for the launcher to start workers that come too late
if FRAMEWORK == "numpy":
    params = state.params.tolist()
elif FRAMEWORK == "torch":
    params = model.weight.detach().view(-1).double().tolist()
elif FRAMEWORK == "tf2":
    params = weights.numpy().tolist()
else:
    params = state.model.get_weights()[0].ravel().astype(float).tolist()
report = {
    "id": ME,
    "rank": hvd.rank(),
    "size": hvd.size(),
    "step": state.step,
    "epoch": getattr(state, "epoch", state.step),
    "samples": state.samples,
    "history": state.history,
    "params": params,
    "resets": len(resets),
    "resumed": resumed,
}
print("DONE " + json.dumps(report), flush=True)
hvd.shutdown()
late_failure = CFG.get("fail_after")
if late_failure and late_failure["id"] == ME:
    time.sleep(late_failure["wait"])
    sys.exit(3)
