"""The state a training run checkpoints, as named components the checkpointer saves and loads.

Each kind of live object has one component class here: a module's weights, an
optimizer's state, a ``state_dict``/``load_state_dict`` object kept as JSON (LR
scheduler, sampler, progress), per-rank RNG states, and the run config (checked,
never installed). The trainer registers them under the names below; a task may
register more.
"""

from veoptim.state.model import ModelState
from veoptim.state.optimizer import OptimizerState
from veoptim.state.rng import RNGState
from veoptim.state.run_config import RunConfigState
from veoptim.state.stateful import JSONState

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
SAMPLER = "sampler"
PROGRESS = "progress"
RNG = "rng"
CONFIG = "config"
RUN_IDS = "run_ids"
#: fp16 runs only: the dynamic loss scaler (``veoptim/optim/loss_scale.py``).
LOSS_SCALE = "loss_scale"

__all__ = [
    "CONFIG",
    "LOSS_SCALE",
    "LR_SCHEDULER",
    "MODEL",
    "OPTIMIZER",
    "PROGRESS",
    "RNG",
    "RUN_IDS",
    "SAMPLER",
    "JSONState",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "RunConfigState",
]
