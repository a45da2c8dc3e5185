"""examples/quickstart.ipynb runs top to bottom (on the demo model the session trained), so it never rots."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_runs(demo_root, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    parameters = nb.cells[1]
    assert parameters.source.startswith("# Parameters")
    parameters.source = f'MODEL = "toy-attn-1l"\nROOT = {str(demo_root)!r}\nTRAIN_STEPS = 2000\nN_PROMPTS = 64'
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the heatmaps were drawn"
    assert any("the most important head: L" in o.get("text", "") for o in outputs)
    assert any("edits batched == " in o.get("text", "") for o in outputs), "your own intervention equals a naive pass"
    assert len(list(demo_root.glob("checkpoints/*/model.safetensors"))) == 1  # the demo model, reused
