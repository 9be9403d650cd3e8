"""Real data-parallel training under ``torchrun``: the process group, the training loop, checkpoints."""

from .bootstrap import DEFAULT_TIMEOUT_S, CollectiveTimeout, exit_process, init_distributed, warn_shared_store_restarts
from .loop import make_record, train_ddp

__all__ = ["DEFAULT_TIMEOUT_S", "CollectiveTimeout", "exit_process", "init_distributed", "make_record", "train_ddp",
           "warn_shared_store_restarts"]
