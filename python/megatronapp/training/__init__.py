"""The training edge: configuration, set-up, the step, the loop, hooks.

    from megatronapp.training import Config, build_parser, train
    summary = train(build_parser().parse_args())

Modules, each calling only the ones below it (docs/architecture.md):

* :mod:`.config` — dataclasses, one field per flag; the argparse is generated
  from them; :meth:`Config.check` runs every check before any collective.
* :mod:`.setup` — explicit builders: process group, parallel state, model
  chunks, DDP, optimizer; :func:`build_run` makes the :class:`Run`.
* :mod:`.grads` — the one place gradients are finished (DP, SP, tied
  embeddings, norm, clipping), for full gradients and ZeRO-1 shards.
* :mod:`.step` — :func:`train_step` through the pipeline executor (one stage
  when pp = 1), and :func:`evaluate`.
* :mod:`.hooks` — the :class:`Hook` protocol and the watchdog, SIGTERM,
  faults, tracing, progress, output and TensorBoard hooks.
* :mod:`.loop` — :func:`train`, the ordered recipe.
"""

from .config import Config, ConfigError, Plan, build_parser
from .grads import clip_grad_norm_, finalize_model_grads, finish_gradients
from .hooks import Hook, default_hooks
from .loop import train
from .setup import (
    Run,
    build_model_chunks,
    build_optimizer,
    build_parallel_state,
    build_run,
    check_config,
    init_distributed,
    install_memory_pool,
    wrap_data_parallel,
)
from .step import StepResult, evaluate, lr_at, schedule_for, train_step

__all__ = ["Config", "ConfigError", "Hook", "Plan", "Run", "StepResult", "build_model_chunks",
           "build_optimizer", "build_parallel_state", "build_parser", "build_run",
           "check_config", "clip_grad_norm_", "default_hooks", "evaluate", "finalize_model_grads",
           "finish_gradients", "init_distributed", "install_memory_pool", "lr_at",
           "schedule_for", "train", "train_step", "wrap_data_parallel"]
