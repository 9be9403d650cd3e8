"""Registry of training tasks. Everything is generated or bundled offline."""

from __future__ import annotations

from typing import Any

from .base import Task, TaskError
from .charlm import CharLM
from .digits import DigitsCNN, DigitsMLP
from .gptlm import GptLM
from .linreg import LinReg
from .logistic_toy import LogisticToy
from .mnist1d import Mnist1dCNN
from .wordlm import WordLM

_TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    _TASKS[cls.name] = cls
    return cls


for _cls in (LinReg, LogisticToy, DigitsMLP, DigitsCNN, Mnist1dCNN, CharLM, WordLM, GptLM):
    register_task(_cls)


def available_tasks() -> dict[str, type[Task]]:
    return dict(_TASKS)


def task_class(name: str) -> type[Task]:
    cls = _TASKS.get(name)
    if cls is None:
        raise TaskError(f"unknown task {name!r}; available: {', '.join(_TASKS)}")
    return cls


def make_task(name: str, workers: int, seed: int = 0, batch_size: int | None = None,
              data: str | None = None, **options: Any) -> Task:
    return task_class(name)(workers, seed=seed, batch_size=batch_size, data=data, **options)


__all__ = ["Task", "TaskError", "available_tasks", "make_task", "register_task", "task_class"]
