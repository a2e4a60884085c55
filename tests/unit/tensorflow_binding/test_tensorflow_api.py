"""hora.tensorflow, hora.tensorflow.keras and hora.keras offer Horovod 0.28.1's names with its
parameters in its order (positional calls keep working), without starting any rank."""

from __future__ import annotations

import inspect
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip(
    "tensorflow", reason="tensorflow is not installed (pip install 'hora[tensorflow]')"
)

import hora.keras as hk  # noqa: E402
import hora.tensorflow as htf  # noqa: E402
import hora.tensorflow.keras as hvk  # noqa: E402

HOROVOD_TF = {
    "allreduce": "tensor average device_dense device_sparse compression op prescale_factor "
    "postscale_factor name process_set ignore_name_scope",
    "grouped_allreduce": "tensors average device_dense device_sparse compression op "
    "prescale_factor postscale_factor process_set ignore_name_scope",
    "allgather": "tensor name ignore_name_scope process_set",
    "grouped_allgather": "tensors name ignore_name_scope process_set",
    "broadcast": "tensor root_rank name ignore_name_scope process_set",
    "broadcast_": "variables root_rank name process_set",
    "alltoall": "tensor splits name ignore_name_scope process_set",
    "reducescatter": "tensor device_dense compression op name process_set ignore_name_scope "
    "prescale_factor postscale_factor",
    "broadcast_variables": "variables root_rank process_set inplace",
    "broadcast_global_variables": "root_rank",
    "BroadcastGlobalVariablesHook": "root_rank device",
    "broadcast_object": "obj root_rank session name process_set",
    "allgather_object": "obj session name process_set",
    "DistributedGradientTape": "gradtape device_dense device_sparse compression sparse_as_dense "
    "op gradient_predivide_factor num_groups groups process_set scale_local_gradients",
    "PartialDistributedGradientTape": "gradtape device_dense device_sparse compression "
    "sparse_as_dense op gradient_predivide_factor num_groups groups process_set local_layers "
    "scale_local_gradients",
    "DistributedOptimizer": "optimizer name use_locking device_dense device_sparse compression "
    "sparse_as_dense backward_passes_per_step op gradient_predivide_factor "
    "average_aggregated_gradients num_groups groups process_set scale_local_gradients",
}
HOROVOD_KERAS = {
    "DistributedOptimizer": "optimizer name device_dense device_sparse compression "
    "sparse_as_dense gradient_predivide_factor op backward_passes_per_step "
    "average_aggregated_gradients num_groups groups process_set scale_local_gradients",
    "PartialDistributedOptimizer": "optimizer name device_dense device_sparse compression "
    "sparse_as_dense gradient_predivide_factor op groups process_set local_layers "
    "scale_local_gradients",
    "load_model": "filepath custom_optimizers custom_objects compression",
    "allreduce": "value name average prescale_factor postscale_factor op compression",
    "allgather": "value name",
    "broadcast": "value root_rank name",
}
HOROVOD_CALLBACKS = {
    "BroadcastGlobalVariablesCallback": "root_rank device local_variables",
    "MetricAverageCallback": "device",
    "LearningRateScheduleCallback": "initial_lr multiplier start_epoch end_epoch staircase "
    "momentum_correction steps_per_epoch",
    "LearningRateWarmupCallback": "initial_lr warmup_epochs momentum_correction "
    "steps_per_epoch verbose",
    "BestModelCheckpoint": "monitor verbose mode save_freq",
}


def params(fn: object) -> list[str]:
    target = fn.__init__ if inspect.isclass(fn) else fn  # type: ignore[misc]
    return [p for p in inspect.signature(target).parameters if p not in ("self", "args", "kwargs")]


@pytest.mark.parametrize("name", sorted(HOROVOD_TF))
def test_tensorflow_signature(name: str) -> None:
    want = HOROVOD_TF[name].split()
    assert params(getattr(htf, name))[: len(want)] == want


@pytest.mark.parametrize("module", [hvk, hk], ids=["tensorflow.keras", "keras"])
@pytest.mark.parametrize("name", sorted(HOROVOD_KERAS))
def test_keras_signature(module: object, name: str) -> None:
    want = HOROVOD_KERAS[name].split()
    if module is hk and name == "DistributedOptimizer":  # horovod.keras's own order
        want = [*want[:8], "num_groups", "groups"]
    assert params(getattr(module, name))[: len(want)] == want


@pytest.mark.parametrize("module", [hvk, hk], ids=["tensorflow.keras", "keras"])
@pytest.mark.parametrize("name", sorted(HOROVOD_CALLBACKS))
def test_callback_signature(module: object, name: str) -> None:
    want = HOROVOD_CALLBACKS[name].split()
    if module is hvk and name == "BestModelCheckpoint":  # horovod.tensorflow.keras's own
        want = [*want[:2], "save_weights_only", *want[2:]]
    assert params(getattr(module.callbacks, name))[: len(want)] == want  # type: ignore[attr-defined]


def test_elastic_names_and_ops() -> None:
    for module in (htf, hvk, hk):
        assert callable(module.elastic.run)
    for name in ("KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
                 "UpdateEpochStateCallback"):  # fmt: skip
        assert hasattr(hvk.elastic, name) and hasattr(hk.elastic, name)
    assert {"TensorFlowState", "TensorFlowKerasState"} <= set(dir(htf.elastic))
    assert (htf.Average, htf.Sum, htf.Adasum, htf.Min, htf.Max, htf.Product) == (0, 1, 2, 3, 4, 5)
    assert htf.Compression.fp16.compress is not None and htf.SyncBatchNormalization
    for name in htf.__all__:
        assert hasattr(htf, name), name
