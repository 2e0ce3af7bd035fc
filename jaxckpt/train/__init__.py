"""Training: the optax train step (AdamW, Adafactor or SGD; state dtype, host offload,
float16 loss scaling) on byte windows or packed data files, held-out
evaluation, orbax checkpoints, data parallel + FSDP
meshes (also over several processes), progress and memory reports. The seed's experiment
(attention x remat) is ``jaxckpt.compare``.

Example:
    >>> from jaxckpt import nn, train
    >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, ffn_dim=48)
    >>> run = train.train(cfg, train.RunConfig(steps=3, batch=2, seq=16, progress=False))
    >>> len(run.steps), run.memory.temp > 0
    (3, True)
"""

from jaxckpt.train._checkpoint import (
    CheckpointWriteError,
    latest_step,
    read_meta,
    restore_checkpoint,
    save_checkpoint,
)
from jaxckpt.train._data import VOCAB_SIZE, ByteBatches, decode, default_corpus_path, encode, load_tokens
from jaxckpt.train._distributed import HEARTBEAT_TIMEOUT_S, initialize, is_primary, resolve_mesh
from jaxckpt.train._eval import Evaluator, evaluate
from jaxckpt.train._grads import loss_and_grads, next_token_loss
from jaxckpt.train._init import PARAMS_KIND, initial_model, source_config, source_hf_fields
from jaxckpt.train._loop import train
from jaxckpt.train._loss_scale import LossScaler, all_finite, keep_if_finite, keep_state_if_finite
from jaxckpt.train._master import has_master_weights
from jaxckpt.train._memory import MemoryReport, memory_report
from jaxckpt.train._nonfinite import ON_NONFINITE, NonFiniteError
from jaxckpt.train._offload import offload_saves_memory, offload_shardings, stream_to_host
from jaxckpt.train._optimizers import MOMENTS_DTYPES, OPTIMIZERS, OptimizerConfig, TrainOptimizer
from jaxckpt.train._orbax_quiet import LOG_NAME as CHECKPOINT_LOG
from jaxckpt.train._orbax_quiet import VERBOSE_LOGGER
from jaxckpt.train._run import TrainRun
from jaxckpt.train._run_config import CheckpointConfig, DataConfig, RunConfig
from jaxckpt.train._sharding import (
    LOGICAL_AXIS_RULES,
    bytes_per_device,
    leaf_spec,
    make_mesh,
    parse_mesh,
    state_shardings,
)
from jaxckpt.train._step import Trainer, jit_train_step
from jaxckpt.train._transforms import (
    clip_by_global_norm,
    keep_state_dtypes,
    scale_by_adam_stored,
    trace_stored,
)

__all__ = [
    "CHECKPOINT_LOG",
    "HEARTBEAT_TIMEOUT_S",
    "LOGICAL_AXIS_RULES",
    "MOMENTS_DTYPES",
    "ON_NONFINITE",
    "OPTIMIZERS",
    "PARAMS_KIND",
    "VERBOSE_LOGGER",
    "VOCAB_SIZE",
    "ByteBatches",
    "CheckpointConfig",
    "CheckpointWriteError",
    "DataConfig",
    "Evaluator",
    "LossScaler",
    "MemoryReport",
    "NonFiniteError",
    "OptimizerConfig",
    "RunConfig",
    "TrainOptimizer",
    "TrainRun",
    "Trainer",
    "all_finite",
    "bytes_per_device",
    "clip_by_global_norm",
    "decode",
    "default_corpus_path",
    "encode",
    "evaluate",
    "has_master_weights",
    "initial_model",
    "initialize",
    "is_primary",
    "jit_train_step",
    "keep_if_finite",
    "keep_state_dtypes",
    "keep_state_if_finite",
    "latest_step",
    "leaf_spec",
    "load_tokens",
    "loss_and_grads",
    "make_mesh",
    "memory_report",
    "next_token_loss",
    "offload_saves_memory",
    "offload_shardings",
    "parse_mesh",
    "read_meta",
    "resolve_mesh",
    "restore_checkpoint",
    "save_checkpoint",
    "scale_by_adam_stored",
    "source_config",
    "source_hf_fields",
    "state_shardings",
    "stream_to_host",
    "trace_stored",
    "train",
]
