"""The table of every knob hora has: one :class:`Knob` per setting.

Each knob names its field, type, default, environment variables (``HORA_*`` first, Horovod's
``HOROVOD_*`` accepted beside it), the ``hora run`` flag that sets it, the section of a Horovod
YAML config file it lives in, and what values are valid (range, choices, a writable path).
Reading, checking and exporting them is :mod:`hora.settings`' work.

Pure data; it imports nothing else of hora.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Knob:
    field: str
    type: type
    default: Any
    env: str  # suffix after HORA_ / HOROVOD_
    doc: str
    flag: str | None = None  # `hora run` flag, when there is one
    section: str | None = None  # Horovod config-file section
    key: str | None = None  # key inside that section
    low: float | None = None  # smallest valid value (numbers)
    high: float | None = None  # largest valid value (numbers)
    positive: bool = False  # must be > 0 (numbers)
    choices: tuple[str, ...] | None = None  # valid values, compared without case (strings)
    path: bool = False  # a file rank 0 writes: its folder must exist and be writable

    @property
    def env_names(self) -> tuple[str, str]:
        return ("HORA_" + self.env, "HOROVOD_" + self.env)


MiB = 1 << 20

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
CONTROLLERS = ("native", "gloo", "mpi")
CPU_OPERATIONS = ("native", "gloo", "mpi", "nccl")
GPU_OPERATIONS = ("nccl", "mpi", "gloo", "native")
# the ops Horovod lets HOROVOD_GPU_<OP> choose a GPU backend for, one by one
GPU_OPS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
CPU_BIND = ("auto", "crowded", "none")
# Libraries Horovod can be built with and hora does not have: name -> what to use instead.
NOT_BUILT = {
    "ccl": "Intel oneCCL",
    "ddl": "IBM DDL",
}

KNOBS: tuple[Knob, ...] = (
    Knob(
        "fusion_threshold",
        int,
        128 * MiB,
        "FUSION_THRESHOLD",
        "Largest fused buffer in bytes; 0 disables tensor fusion.",
        "--fusion-threshold-mb",
        "params",
        "fusion_threshold_mb",
        low=0,
    ),
    Knob(
        "cycle_time_ms",
        float,
        1.0,
        "CYCLE_TIME",
        "Engine cycle time in milliseconds (an idle engine still wakes at once on a new op).",
        "--cycle-time-ms",
        "params",
        "cycle_time_ms",
        low=0,
    ),
    Knob(
        "cache_capacity",
        int,
        1024,
        "CACHE_CAPACITY",
        "Response-cache entries; 0 turns the cache off.",
        "--cache-capacity",
        "params",
        "cache_capacity",
        low=0,
    ),
    Knob(
        "fast_path",
        bool,
        True,
        "FAST_PATH",
        "Steady state without the coordinator: ranks agree on cached tensors among themselves.",
        None,
        None,
        None,
    ),
    Knob(
        "compress_on_one_host",
        bool,
        False,
        "COMPRESS_ON_ONE_HOST",
        "Cast gradients for Compression.fp16 and .bf16 in a job whose ranks all share one host "
        "too. Off (default): there tensors go uncompressed through shared memory, where the "
        "casts cost more than the halved copies save.",
        None,
        None,
        None,
    ),
    Knob(
        "local_sets",
        bool,
        True,
        "LOCAL_SETS",
        "A process set of one (a world of one) runs its collectives in the caller's thread, "
        "with no engine round; 0 sends them through the engine as a larger set's.",
        None,
        None,
        None,
    ),
    Knob(
        "hierarchical_allreduce",
        bool,
        False,
        "HIERARCHICAL_ALLREDUCE",
        "Reduce inside each host, then across hosts.",
        "--hierarchical-allreduce",
        "params",
        "hierarchical_allreduce",
    ),
    Knob(
        "hierarchical_allgather",
        bool,
        False,
        "HIERARCHICAL_ALLGATHER",
        "Gather inside each host, then across hosts.",
        "--hierarchical-allgather",
        "params",
        "hierarchical_allgather",
    ),
    Knob(
        "torus_allreduce",
        bool,
        False,
        "TORUS_ALLREDUCE",
        "Two-dimensional torus allreduce (accepted; runs as hierarchical).",
        "--torus-allreduce",
        "params",
        "torus_allreduce",
    ),
    Knob(
        "timeline",
        str,
        "",
        "TIMELINE",
        "Timeline JSON file of rank 0 (with {rank} in the path: of every rank), or DYNAMIC.",
        "--timeline-filename",
        "timeline",
        "filename",
        path=True,
    ),
    Knob(
        "timeline_mark_cycles",
        bool,
        False,
        "TIMELINE_MARK_CYCLES",
        "Mark every engine cycle in the timeline.",
        "--timeline-mark-cycles",
        "timeline",
        "mark_cycles",
    ),
    Knob(
        "autotune",
        bool,
        False,
        "AUTOTUNE",
        "Tune fusion threshold and cycle time online.",
        "--autotune",
        "autotune",
        "enabled",
    ),
    Knob(
        "autotune_log",
        str,
        "",
        "AUTOTUNE_LOG",
        "CSV file of autotuning samples.",
        "--autotune-log-file",
        "autotune",
        "log_file",
        path=True,
    ),
    Knob(
        "autotune_warmup_samples",
        int,
        3,
        "AUTOTUNE_WARMUP_SAMPLES",
        "Autotune samples discarded at the start.",
        "--autotune-warmup-samples",
        "autotune",
        "warmup_samples",
        low=0,
    ),
    Knob(
        "autotune_steps_per_sample",
        int,
        10,
        "AUTOTUNE_STEPS_PER_SAMPLE",
        "Engine cycles per autotune sample.",
        "--autotune-steps-per-sample",
        "autotune",
        "steps_per_sample",
        low=1,
    ),
    Knob(
        "autotune_bayes_opt_max_samples",
        int,
        20,
        "AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
        "Most Bayesian-optimisation samples.",
        "--autotune-bayes-opt-max-samples",
        "autotune",
        "bayes_opt_max_samples",
        low=0,
    ),
    Knob(
        "autotune_gaussian_process_noise",
        float,
        0.8,
        "AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
        "Noise of the autotuner's Gaussian process.",
        "--autotune-gaussian-process-noise",
        "autotune",
        "gaussian_process_noise",
        low=0,
        high=1,
    ),
    Knob(
        "stall_check_disable",
        bool,
        False,
        "STALL_CHECK_DISABLE",
        "Turn the stall inspector off.",
        "--no-stall-check",
        "stall_check",
        "enabled",
    ),
    Knob(
        "stall_check_time_seconds",
        float,
        60.0,
        "STALL_CHECK_TIME_SECONDS",
        "Seconds before the stall inspector warns about ranks that did not submit a tensor.",
        "--stall-check-warning-time-seconds",
        "stall_check",
        "warning_time_seconds",
        low=0,
    ),
    Knob(
        "stall_shutdown_time_seconds",
        float,
        0.0,
        "STALL_SHUTDOWN_TIME_SECONDS",
        "Seconds of stall after which the job shuts down (0: never).",
        "--stall-check-shutdown-time-seconds",
        "stall_check",
        "shutdown_time_seconds",
        low=0,
    ),
    Knob(
        "log_level",
        str,
        "WARNING",
        "LOG_LEVEL",
        "TRACE, DEBUG, INFO, WARNING, ERROR or FATAL.",
        "--log-level",
        "logging",
        "level",
        choices=LOG_LEVELS,
    ),
    Knob(
        "log_hide_time",
        bool,
        False,
        "LOG_HIDE_TIME",
        "Leave the time out of log lines.",
        "--log-without-timestamp",
        "logging",
        "hide_timestamp",
    ),
    Knob(
        "tf_logs",
        bool,
        False,
        "TF_LOGS",
        "Show TensorFlow's own logs in the workers' output. Off (default): the launcher drops "
        "TensorFlow's start-up notes from each worker's stderr and gives workers "
        "TF_CPP_MIN_LOG_LEVEL=1 unless it is set (INFO hidden; warnings and errors kept).",
        "--tf-logs",
    ),
    Knob(
        "controller",
        str,
        "",
        "CONTROLLER",
        "Negotiation controller: native (default), gloo or mpi.",
        None,
        "controller",
        None,
        choices=CONTROLLERS,
    ),
    Knob(
        "cpu_operations",
        str,
        "",
        "CPU_OPERATIONS",
        "Backend for CPU data: native (default), gloo, mpi or ccl.",
        None,
        None,
        None,
        choices=CPU_OPERATIONS,
    ),
    Knob(
        "gpu_operations",
        str,
        "",
        "GPU_OPERATIONS",
        "Backend for GPU data: nccl or mpi.",
        None,
        None,
        None,
        choices=GPU_OPERATIONS,
    ),
    *(
        Knob(
            f"gpu_{op}",
            str,
            "",
            f"GPU_{op.upper()}",
            f"Backend for GPU {op} (Horovod's per-op form of GPU_OPERATIONS, which it overrides; "
            "hora runs every op of a job through one backend, so all that are set must agree).",
            None,
            None,
            None,
            choices=GPU_OPERATIONS,
        )
        for op in GPU_OPS
    ),
    Knob(
        "dynamic_process_sets",
        bool,
        False,
        "DYNAMIC_PROCESS_SETS",
        "Allow add_process_set/remove_process_set after init.",
        None,
        None,
        None,
    ),
    Knob(
        "elastic", bool, False, "ELASTIC", "Set by the launcher for elastic jobs.", None, None, None
    ),
    Knob(
        "elastic_timeout",
        float,
        600.0,
        "ELASTIC_TIMEOUT",
        "Elastic: seconds to wait for the job to be re-formed after a failure or a host change.",
        None,
        None,
        None,
        positive=True,
    ),
    Knob(
        "gloo_timeout_seconds",
        float,
        30.0,
        "GLOO_TIMEOUT_SECONDS",
        "Seconds to wait for peers while connecting.",
        "--gloo-timeout-seconds",
        "library_options",
        "gloo_timeout_seconds",
        positive=True,
    ),
    Knob("gloo_iface", str, "", "GLOO_IFACE", "Network interface to listen on.", None, None, None),
    Knob(
        "handshake_timeout_seconds",
        float,
        5.0,
        "HANDSHAKE_TIMEOUT_SECONDS",
        "Seconds an incoming connection has for its whole handshake before it is dropped "
        "(rendezvous store and every rank's listeners).",
        None,
        None,
        None,
        positive=True,
    ),
    Knob(
        "listen_any",
        bool,
        False,
        "LISTEN_ANY",
        "Listen on every interface (0.0.0.0) instead of loopback (local jobs) or the job's "
        "interface (multi-host jobs).",
        None,
        None,
        None,
    ),
    Knob(
        "mpi_threads_disable",
        bool,
        False,
        "MPI_THREADS_DISABLE",
        "Initialise MPI with MPI_THREAD_SERIALIZED instead of MPI_THREAD_MULTIPLE "
        "(hvd.mpi_threads_supported() is then False).",
        "--mpi-threads-disable",
        "library_options",
        "mpi_threads_disable",
    ),
    Knob(
        "shm_disable",
        bool,
        False,
        "SHM_DISABLE",
        "Use TCP even between ranks on the same host.",
        None,
        None,
        None,
    ),
    Knob(
        "shm_single_copy",
        bool,
        True,
        "SHM_SINGLE_COPY",
        "0: stage every shared-memory payload through a shared segment instead of reading "
        "peers' memory (process_vm_readv), the way a host with Yama's ptrace_scope=1 "
        "(Ubuntu's default) runs; the shared arena still maps (see docs/shm.md).",
        None,
        None,
        None,
    ),
    Knob(
        "cpu_bind",
        str,
        "crowded",
        "CPU_BIND",
        "crowded (default): on a host with more local ranks than cores, give each rank one "
        "core, the cores dealt out in turn, where its threads fit one core (and nothing bound "
        "the process already); elsewhere leave placement to the OS. none: always leave it to "
        "the OS. auto: also give each local rank its own slice of the cores on a host with a "
        "core or more per rank, which speeds up hora's small collectives but confines "
        "everything else the process runs (DataLoader workers, torch.distributed) to that "
        "slice, which can slow training on a shared host.",
        "--cpu-bind",
        "library_options",
        "cpu_bind",
        choices=CPU_BIND,
    ),
    Knob(
        "thread_affinity",
        str,
        "",
        "THREAD_AFFINITY",
        "Cores to pin the engine thread to, one per local rank (comma-separated; local rank i "
        "takes the i-th).",
        "--thread-affinity",
        "library_options",
        "thread_affinity",
    ),
    Knob(
        "num_nccl_streams",
        int,
        1,
        "NUM_NCCL_STREAMS",
        "NCCL streams per device (accepted for Horovod; hora's NCCL backend runs on one "
        "torch.distributed process group, so it changes nothing).",
        "--num-nccl-streams",
        "library_options",
        "num_nccl_streams",
        low=0,
    ),
)

KNOB_BY_FIELD: dict[str, Knob] = {k.field: k for k in KNOBS}
