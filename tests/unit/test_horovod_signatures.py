"""The parameters of hora's public functions, classes and methods that Horovod (v0.28.1) also has
come in Horovod's order, so that a positional call binds as it does there; hora's extra
parameters come after Horovod's and, where they are not Horovod's, keyword-only.

HOROVOD holds Horovod's parameter names in order (``self``, ``*args`` and ``**kwargs`` left
out), per hora module and name (``Class`` for its constructor, ``Class.method``). KNOWN lists
what still differs, each with why; an entry that stops differing fails, so that it is deleted.
"""

from __future__ import annotations

import importlib
import inspect
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HOROVOD: dict[str, dict[str, str]] = {
    "hora.runner": {
        "run": (
            "func args kwargs num_proc min_num_proc max_num_proc slots reset_limit "
            "cooldown_range hosts hostfile host_discovery_script start_timeout "
            "ssh_port ssh_identity_file disable_cache output_filename verbose "
            "use_gloo use_mpi mpi_args network_interface network_interfaces "
            "executable np min_np max_np"
        ),
    },
    "hora.torch": {
        "DistributedOptimizer": (
            "optimizer named_parameters compression backward_passes_per_step op "
            "gradient_predivide_factor num_groups groups sparse_as_dense "
            "process_set"
        ),
        "ProcessSet": "ranks_or_comm",
        "SyncBatchNorm": "num_features eps momentum affine track_running_stats",
        "SyncBatchNorm.forward": "input",
        "add_process_set": "process_set",
        "allgather": "tensor name process_set",
        "allgather_async": "tensor name process_set",
        "allgather_object": "obj name",
        "allreduce": (
            "tensor average name compression op prescale_factor postscale_factor process_set"
        ),
        "allreduce_": "tensor average name op prescale_factor postscale_factor process_set",
        "allreduce_async": "tensor average name op prescale_factor postscale_factor process_set",
        "allreduce_async_": "tensor average name op prescale_factor postscale_factor process_set",
        "alltoall": "tensor splits name process_set",
        "alltoall_async": "tensor splits name process_set",
        "barrier": "process_set",
        "broadcast": "tensor root_rank name process_set",
        "broadcast_": "tensor root_rank name process_set",
        "broadcast_async": "tensor root_rank name process_set",
        "broadcast_async_": "tensor root_rank name process_set",
        "broadcast_object": "obj root_rank name process_set",
        "broadcast_optimizer_state": "optimizer root_rank model",
        "broadcast_parameters": "params root_rank",
        "check_extension": "ext_name ext_env_var pkg_path",
        "grouped_allgather": "tensors name process_set",
        "grouped_allgather_async": "tensors name process_set",
        "grouped_allreduce": (
            "tensors average name compression op prescale_factor postscale_factor process_set"
        ),
        "grouped_allreduce_": (
            "tensors average name op prescale_factor postscale_factor process_set"
        ),
        "grouped_allreduce_async": (
            "tensors average name op prescale_factor postscale_factor process_set"
        ),
        "grouped_allreduce_async_": (
            "tensors average name op prescale_factor postscale_factor process_set"
        ),
        "grouped_reducescatter": (
            "tensors name compression op process_set prescale_factor postscale_factor"
        ),
        "grouped_reducescatter_async": (
            "tensors name op process_set prescale_factor postscale_factor"
        ),
        "join": "device",
        "poll": "handle",
        "reducescatter": "tensor name compression op process_set prescale_factor postscale_factor",
        "reducescatter_async": "tensor name op process_set prescale_factor postscale_factor",
        "remove_process_set": "process_set",
        "sparse_allreduce_async": "tensor name op process_set",
        "synchronize": "handle",
    },
    "hora.torch.mpi_ops": {
        "HorovodAllgather.backward": "ctx grad_output",
        "HorovodAllgather.forward": "ctx tensor name process_set",
        "HorovodAllreduce.backward": "ctx grad_output",
        "HorovodAllreduce.forward": (
            "ctx tensor average name op prescale_factor postscale_factor process_set"
        ),
        "HorovodAlltoall.backward": "ctx grad_output",
        "HorovodAlltoall.forward": "ctx tensor splits name process_set",
        "HorovodBroadcast.backward": "ctx grad_output",
        "HorovodBroadcast.forward": "ctx tensor root_rank name process_set",
        "HorovodGroupedAllgather.backward": "ctx",
        "HorovodGroupedAllgather.forward": "ctx name process_set",
        "HorovodGroupedAllreduce.backward": "ctx",
        "HorovodGroupedAllreduce.forward": (
            "ctx average name op prescale_factor postscale_factor process_set"
        ),
        "HorovodGroupedReducescatter.backward": "ctx",
        "HorovodGroupedReducescatter.forward": (
            "ctx name op process_set prescale_factor postscale_factor"
        ),
        "HorovodReducescatter.backward": "ctx grad_output",
        "HorovodReducescatter.forward": (
            "ctx tensor name op process_set prescale_factor postscale_factor"
        ),
        "ProcessSet": "ranks_or_comm",
        "add_process_set": "process_set",
        "allgather": "tensor name process_set",
        "allgather_async": "tensor name process_set",
        "allreduce": (
            "tensor average name compression op prescale_factor postscale_factor process_set"
        ),
        "allreduce_": "tensor average name op prescale_factor postscale_factor process_set",
        "allreduce_async": "tensor average name op prescale_factor postscale_factor process_set",
        "allreduce_async_": "tensor average name op prescale_factor postscale_factor process_set",
        "alltoall": "tensor splits name process_set",
        "alltoall_async": "tensor splits name process_set",
        "barrier": "process_set",
        "broadcast": "tensor root_rank name process_set",
        "broadcast_": "tensor root_rank name process_set",
        "broadcast_async": "tensor root_rank name process_set",
        "broadcast_async_": "tensor root_rank name process_set",
        "check_installed_version": "name version exception",
        "get_average_backwards_compatibility_fun": "reduce_ops",
        "gpu_available": "ext_base_name verbose",
        "grouped_allgather": "tensors name process_set",
        "grouped_allgather_async": "tensors name process_set",
        "grouped_allreduce": (
            "tensors average name compression op prescale_factor postscale_factor process_set"
        ),
        "grouped_allreduce_": (
            "tensors average name op prescale_factor postscale_factor process_set"
        ),
        "grouped_allreduce_async": (
            "tensors average name op prescale_factor postscale_factor process_set"
        ),
        "grouped_allreduce_async_": (
            "tensors average name op prescale_factor postscale_factor process_set"
        ),
        "grouped_reducescatter": (
            "tensors name compression op process_set prescale_factor postscale_factor"
        ),
        "grouped_reducescatter_async": (
            "tensors name op process_set prescale_factor postscale_factor"
        ),
        "join": "device",
        "num_rank_is_power_2": "num_rank",
        "poll": "handle",
        "reducescatter": "tensor name compression op process_set prescale_factor postscale_factor",
        "reducescatter_async": "tensor name op process_set prescale_factor postscale_factor",
        "remove_process_set": "process_set",
        "sparse_allreduce_async": "tensor name op process_set",
        "synchronize": "handle",
    },
    "hora.torch.elastic": {
        "ElasticSampler": "dataset shuffle seed",
        "ElasticSampler.load_state_dict": "state_dict",
        "ElasticSampler.record_batch": "batch_idx batch_size",
        "ElasticSampler.set_epoch": "epoch",
        "TorchState": "model optimizer",
        "run": "func",
    },
    "hora.tensorflow": {
        "BroadcastGlobalVariablesHook": "root_rank device",
        "BroadcastGlobalVariablesHook.after_create_session": "session coord",
        "DistributedGradientTape": (
            "gradtape device_dense device_sparse compression sparse_as_dense op "
            "gradient_predivide_factor num_groups groups process_set "
            "scale_local_gradients"
        ),
        "DistributedOptimizer": (
            "optimizer name use_locking device_dense device_sparse compression "
            "sparse_as_dense backward_passes_per_step op gradient_predivide_factor "
            "average_aggregated_gradients num_groups groups process_set "
            "scale_local_gradients"
        ),
        "PartialDistributedGradientTape": (
            "gradtape device_dense device_sparse compression sparse_as_dense op "
            "gradient_predivide_factor num_groups groups process_set local_layers "
            "scale_local_gradients"
        ),
        "ProcessSet": "ranks_or_comm",
        "add_process_set": "process_set",
        "allgather": "tensor name ignore_name_scope process_set",
        "allgather_object": "obj session name process_set",
        "allreduce": (
            "tensor average device_dense device_sparse compression op "
            "prescale_factor postscale_factor name process_set ignore_name_scope"
        ),
        "alltoall": "tensor splits name ignore_name_scope process_set",
        "broadcast": "tensor root_rank name ignore_name_scope process_set",
        "broadcast_": "variables root_rank name process_set",
        "broadcast_global_variables": "root_rank",
        "broadcast_object": "obj root_rank session name process_set",
        "broadcast_object_fn": "root_rank session name process_set",
        "broadcast_variables": "variables root_rank process_set inplace",
        "grouped_allgather": "tensors name ignore_name_scope process_set",
        "grouped_allreduce": (
            "tensors average device_dense device_sparse compression op "
            "prescale_factor postscale_factor process_set ignore_name_scope name"
        ),
        "grouped_reducescatter": (
            "tensors device_dense compression op process_set prescale_factor postscale_factor"
        ),
        "local_rank_op": "name",
        "local_size_op": "name",
        "process_set_included_op": "process_set_id name",
        "rank_op": "name",
        "reducescatter": (
            "tensor device_dense compression op name process_set ignore_name_scope "
            "prescale_factor postscale_factor"
        ),
        "remove_process_set": "process_set",
        "size_op": "process_set_id name",
        "SyncBatchNormalization": "fused",
    },
    "hora.tensorflow.keras": {
        "DistributedOptimizer": (
            "optimizer name device_dense device_sparse compression sparse_as_dense "
            "gradient_predivide_factor op backward_passes_per_step "
            "average_aggregated_gradients num_groups groups process_set "
            "scale_local_gradients"
        ),
        "ProcessSet": "ranks_or_comm",
        "add_process_set": "process_set",
        "allgather": "value name",
        "allreduce": "value name average prescale_factor postscale_factor op compression",
        "broadcast": "value root_rank name",
        "broadcast_global_variables": "root_rank",
        "load_model": "filepath custom_optimizers custom_objects compression legacy_opts",
        "reducescatter": "value name op",
        "remove_process_set": "process_set",
    },
    "hora.tensorflow.keras.callbacks": {
        "BestModelCheckpoint": "monitor verbose save_weights_only mode save_freq",
        "BroadcastGlobalVariablesCallback": "root_rank device local_variables",
        "LearningRateScheduleCallback": (
            "initial_lr multiplier start_epoch end_epoch staircase "
            "momentum_correction steps_per_epoch"
        ),
        "LearningRateWarmupCallback": (
            "initial_lr warmup_epochs momentum_correction steps_per_epoch verbose"
        ),
        "MetricAverageCallback": "device",
    },
    "hora.tensorflow.keras.elastic": {
        "CommitStateCallback": "state batches_per_commit",
        "KerasState": "model optimizer",
        "TensorFlowKerasState": "model optimizer backend",
        "UpdateBatchStateCallback": "state",
        "UpdateEpochStateCallback": "state",
        "run": "func",
    },
    "hora.keras": {
        "DistributedOptimizer": (
            "optimizer name device_dense device_sparse compression sparse_as_dense "
            "gradient_predivide_factor op num_groups groups"
        ),
        "PartialDistributedOptimizer": (
            "optimizer name device_dense device_sparse compression sparse_as_dense "
            "gradient_predivide_factor op groups process_set local_layers "
            "scale_local_gradients"
        ),
        "allgather": "value name",
        "allreduce": "value name average prescale_factor postscale_factor op compression",
        "broadcast": "value root_rank name",
        "broadcast_global_variables": "root_rank",
        "load_model": "filepath custom_optimizers custom_objects compression legacy_opts",
        "reducescatter": "value name op",
    },
    "hora.keras.callbacks": {
        "BestModelCheckpoint": "monitor verbose mode save_freq",
        "BroadcastGlobalVariablesCallback": "root_rank device local_variables",
        "LearningRateScheduleCallback": (
            "initial_lr multiplier start_epoch end_epoch staircase "
            "momentum_correction steps_per_epoch"
        ),
        "LearningRateWarmupCallback": (
            "initial_lr warmup_epochs momentum_correction steps_per_epoch verbose"
        ),
        "MetricAverageCallback": "device",
    },
    "hora.keras.elastic": {
        "CommitStateCallback": "state batches_per_commit",
        "KerasState": "model optimizer",
        "TensorFlowKerasState": "model optimizer backend",
        "UpdateBatchStateCallback": "state",
        "UpdateEpochStateCallback": "state",
        "run": "func",
    },
    "hora.spark": {
        "run": (
            "fn args kwargs num_proc start_timeout use_mpi use_gloo extra_mpi_args "
            "env stdout stderr verbose nics prefix_output_with_timestamp executable"
        ),
        "run_elastic": (
            "fn args kwargs num_proc min_num_proc max_num_proc start_timeout "
            "elastic_timeout reset_limit env stdout stderr verbose nics "
            "prefix_output_with_timestamp min_np max_np"
        ),
    },
    "hora.ray": {
        "RayExecutor": (
            "settings num_workers num_hosts num_workers_per_host cpus_per_worker "
            "use_gpu gpus_per_worker use_current_placement_group min_workers "
            "max_workers reset_limit cooldown_range elastic_timeout "
            "override_discovery"
        ),
        "RayExecutor.create_settings": (
            "timeout_s ssh_identity_file ssh_str placement_group_timeout_s nics"
        ),
        "RayExecutor.execute": "fn callbacks",
        "RayExecutor.execute_single": "fn",
        "RayExecutor.run": "fn args kwargs callbacks",
        "RayExecutor.run_remote": "fn args kwargs",
        "RayExecutor.start": "executable_cls executable_args executable_kwargs extra_env_vars",
        "ElasticRayExecutor": (
            "settings use_gpu cpus_per_slot gpus_per_slot env_vars override_discovery"
        ),
        "ElasticRayExecutor.create_settings": (
            "min_num_proc max_num_proc reset_limit elastic_timeout timeout_s "
            "ssh_identity_file nics min_np max_np"
        ),
        "ElasticRayExecutor.run": "worker_fn callbacks",
    },
    "hora.tensorflow.elastic": {
        "ObjectState": "bcast_object get_rank",
        "TensorFlowKerasState": "model optimizer backend",
        "TensorFlowState": "variables session",
        "broadcast_object": "obj root_rank session name process_set",
        "broadcast_variables": "variables root_rank process_set inplace",
        "run": "func",
    },
}

# hora-only parameters that are still positional after Horovod's (allowed, but listed).
POSITIONAL_EXTRAS: dict[tuple[str, str], list[str]] = {}

# Where hora still differs from Horovod (name: (Horovod's order, why)).
KNOWN: dict[tuple[str, str], tuple[str, str]] = {}


def _resolve(module: str, name: str) -> tuple[object, bool]:
    obj: object = importlib.import_module(module)
    parts = name.split(".")
    for part in parts:
        owner, obj = obj, getattr(obj, part)
    method = len(parts) > 1 and not isinstance(
        inspect.getattr_static(owner, parts[-1]), staticmethod
    )
    return obj, method


def _params(module: str, name: str) -> list[inspect.Parameter]:
    obj, method = _resolve(module, name)
    params = list(inspect.signature(obj).parameters.values())  # type: ignore[arg-type]
    if method and params and params[0].name in ("self", "cls"):
        params = params[1:]
    return [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


CASES = [(m, n) for m, names in HOROVOD.items() for n in names]


@pytest.mark.parametrize(("module", "name"), CASES, ids=[f"{m}:{n}" for m, n in CASES])
def test_horovods_parameters_come_first_in_its_order(module: str, name: str) -> None:
    want = HOROVOD[module][name].split()
    params = _params(module, name)
    got = [p.name for p in params]
    assert got[: len(want)] == want, f"{module}.{name}: Horovod's order is {want}, hora's {got}"
    for p in params[: len(want)]:
        assert p.kind != p.KEYWORD_ONLY or not any(
            q.kind == q.POSITIONAL_OR_KEYWORD for q in params[params.index(p) :]
        ), f"{module}.{name}: {p.name} is keyword-only before positional parameters"
    extra = [p.name for p in params[len(want) :] if p.kind != p.KEYWORD_ONLY]
    assert extra == POSITIONAL_EXTRAS.get((module, name), []), (
        f"{module}.{name}: hora's extra parameters {extra} must be keyword-only"
    )


def test_known_differences_still_differ() -> None:
    matching = [
        f"{module}.{name}"
        for (module, name), (order, _why) in KNOWN.items()
        if [p.name for p in _params(module, name)][: len(order.split())] == order.split()
    ]
    assert not matching, f"{matching} match Horovod now: move them to HOROVOD"


def test_the_table_covers_the_apis() -> None:
    assert {"hora.runner", "hora.torch", "hora.torch.mpi_ops", "hora.tensorflow", "hora.keras",
            "hora.tensorflow.keras", "hora.spark", "hora.ray"} <= set(HOROVOD)  # fmt: skip
    assert HOROVOD["hora.runner"]["run"].split()[21:24] == [
        "network_interface",
        "network_interfaces",
        "executable",
    ]
