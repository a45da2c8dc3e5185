"""Studies: one module per study, each a Study record (study.py) in one registry keyed by name
(registry.py); runner.py runs one into a run dir, summary.py holds what the summaries share.

sweep.py (ablation / patching sweeps), circuit.py (edge circuits), recall_reasoning.py, sinks.py,
composition.py, retrieval.py (head scores), pathnet.py (the Markov chain task on PathNet), train.py
(`headlab train`), sae.py (`headlab sae`).
"""

from .context import RunContext as RunContext
from .registry import get as get
from .registry import register as register
from .registry import study_for as study_for
from .runner import already_done as already_done
from .runner import execute_run as execute_run
from .study import Study as Study
from .study import StudyOptions as StudyOptions
