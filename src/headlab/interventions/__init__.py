"""Interventions on attention heads and MLPs: what to do (plan), how to do it (edits), and running it.

  plan.py          Intervention (one row of the result table), its Edits, and the plan a config expands to
  edits.py         replacement values (Sources), site indexing and the hooks that edit stacked copies
  sinks.py         real tokens and hidden attention sinks, which sink calibration edits and analyses score
  engine.py        execute (the batched sweep) and execute_joint (several layers at once)
  path.py          path patching
  attribution_patching.py   attribution patching (a first-order estimate of activation patching)
  user.py          what a user hands in (headlab.execute): specs checked at the door, their own edits
The names of sites, sources, kinds and methods are those of headlab.vocabulary.
"""

from __future__ import annotations

from .plan import CLEAN as CLEAN
from .plan import Edit as Edit
from .plan import Intervention as Intervention
from .plan import plan as plan
from .plan import receiver_heads as receiver_heads
