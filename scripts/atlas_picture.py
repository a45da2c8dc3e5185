"""The atlas pictures of README.md and the docs (docs/atlas_smollm2.png, docs/atlas_gemma3.png), from a fresh atlas.

    .venv/bin/python scripts/atlas_picture.py smollm2-135m docs/atlas_smollm2.png [--root DIR]

runs `headlab atlas model=MODEL` into DIR (default: a new temporary directory, so no probe is read from a
cache and the wall clock is the atlas's own), prints `atlas_seconds: S` with the load beside it (and appends
those lines to --log FILE), and takes a 1200 x 900 screenshot of its page in headless Chromium (the Debian
package `chromium`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=None, help="also append the `name: value` lines to this file")
    args = parser.parse_args()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    browser = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if browser is None:
        print("error: no Chromium found (Debian package: chromium)", file=sys.stderr)
        return 1
    root = args.root or Path(tempfile.mkdtemp(prefix="atlas-picture-"))
    run_dir = root / "atlas"
    headlab = Path(sys.executable).with_name("headlab")
    say(f"model: {args.model}")
    say(f"load_1min_before: {os.getloadavg()[0]:.2f}")
    start = time.perf_counter()
    done = subprocess.run(  # its own output on stderr: stdout holds this script's `name: value` lines
        [str(headlab), "atlas", f"model={args.model}", f"output.root={root}", f"hydra.run.dir={run_dir}"],
        check=False,
        stdout=sys.stderr,
    )
    say(f"atlas_seconds: {time.perf_counter() - start:.1f}")
    say(f"load_1min_after: {os.getloadavg()[0]:.2f}")
    say(f"cpus: {os.cpu_count()}")
    page = next(run_dir.glob("*.html"), None) if done.returncode == 0 else None
    if page is None:
        print(f"error: the atlas of {args.model} wrote no page under {run_dir}", file=sys.stderr)
        return 1
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={root / 'profile'}"]
    shot = subprocess.run(
        [browser, *flags, f"--screenshot={args.out.resolve()}", "--window-size=1200,900", page.resolve().as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if shot.returncode != 0 or not args.out.is_file():
        print(f"error: Chromium took no screenshot: {shot.stderr.strip()[:150]}", file=sys.stderr)
        return 1
    say(f"picture: {args.out}")
    if args.log is not None:
        with args.log.open("a") as log:
            log.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
