"""headlab report: one self-contained HTML file; rendered in headless Chromium when one is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report(tmp_path_factory, demo_root):
    root = tmp_path_factory.mktemp("report")
    sweep = root / "sweep"
    args = [
        "run",
        "-m",
        "ablate.method=zero,mean",
        "task.n_prompts=32",
        "output.n_boot=20",
        f"output.root={demo_root}",
        f"hydra.sweep.dir={sweep}",
    ]
    subprocess.run([sys.executable, "-m", "headlab", *args], cwd=root, check=True, capture_output=True)
    (sweep / "figures").mkdir()
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, 1])
    fig.savefig(sweep / "figures" / "line.png")
    proc = subprocess.run(
        [sys.executable, "-m", "headlab", "report", str(sweep)], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return sweep / "report.html"


def test_report_is_self_contained_and_holds_config_tables_figures_timings(report):
    text = report.read_text()
    for section in ("Jobs", "Figures", "Results", "Timings (seconds)", "Configuration"):
        assert f"<h2>{section}</h2>" in text
    assert text.count("data:image/png;base64,") == 1
    assert "label_acc" in text and "ablate_head" in text and "method: zero" in text  # table and config
    assert "ablate.method=mean" in text  # the second job's overrides
    assert "src=" not in text.replace("src='data:", "")  # nothing loaded from elsewhere


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian package: chromium)")
def test_report_renders_in_headless_chromium(report, tmp_path):
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=120)
    assert "<h2>Results</h2>" in dom.stdout and "label_acc" in dom.stdout
    shot = tmp_path / "report.png"
    subprocess.run(
        [CHROMIUM, *flags, f"--screenshot={shot}", "--window-size=1200,1600", report.as_uri()],
        capture_output=True,
        timeout=120,
    )
    assert shot.is_file() and shot.stat().st_size > 20_000  # a page with tables and a figure, not a blank one
