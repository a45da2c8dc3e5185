"""examples/quickstart.ipynb runs top to bottom (with a shorter training run), so it never rots."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    parameters = nb.cells[1]
    assert parameters.source.startswith("# Parameters")
    parameters.source = f"ROOT = {str(tmp_path)!r}\nTRAIN_STEPS = 300\nN_PROMPTS = 64"
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the heatmaps were drawn"
    assert any("the most important head: L" in o.get("text", "") for o in outputs)
    assert list(tmp_path.glob("checkpoints/toy-attn-2l-*/model.safetensors"))
