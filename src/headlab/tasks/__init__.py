"""Tasks: data generation, counterfactuals, answers and metrics. One module per task.

base.py holds the contract every task meets (TaskData, Task), registry.py the built-in tasks by name.
"""

from .base import Aggregate as Aggregate
from .base import Inputs as Inputs
from .base import Task as Task
from .base import TaskData as TaskData
from .base import mean_of as mean_of
from .base import nanmean_of as nanmean_of
from .base import nanmean_ratio_of as nanmean_ratio_of
from .prompts import from_file as from_file
from .prompts import from_records as from_records
from .registry import build_task as build_task
from .registry import task_names as task_names
