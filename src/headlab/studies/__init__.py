"""Studies: one module per study behind one contract, `run(ctx: RunContext) -> tidy table`.

sweep.py (the plain ablation / patching sweep), circuits.py (recall vs reasoning), pathnet.py (the
Markov chain task on PathNet), sae.py (`headlab sae`), train.py (`headlab train`); registry.py picks the
study a config asks for and runner.py runs it into a run dir.
"""

from .context import RunContext as RunContext
from .registry import study_for as study_for
from .runner import already_done as already_done
from .runner import execute_run as execute_run
