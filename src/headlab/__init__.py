"""headlab: experiment runner for attention-head interpretability.

The Python API (api.py) is the front door; the `headlab` command is a shell over the same calls.
"""

from .api import RunResult as RunResult
from .api import Verdict as Verdict
from .api import atlas as atlas
from .api import check as check
from .api import circuit as circuit
from .api import compose as compose
from .api import execute as execute
from .api import load_model as load_model
from .api import load_task as load_task
from .api import plan as plan
from .api import reuse as reuse
from .api import run as run
from .api import scores as scores
from .api import study as study
from .api import sweep as sweep
from .errors import HeadlabError as HeadlabError
from .errors import UsageError as UsageError
from .interventions import Intervention as Intervention

__version__ = "0.6.0"
