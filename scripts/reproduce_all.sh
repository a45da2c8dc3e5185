#!/usr/bin/env bash
# Rebuild every paper figure in batch: finished runs and trained models are reused, so a second call
# only redraws. Extra arguments go to each `headlab reproduce` (e.g. --quick, --root DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
HEADLAB=${HEADLAB:-.venv/bin/headlab}
status=0
for name in $("$HEADLAB" reproduce --list | awk '{print $1}'); do
  echo "== $name"
  "$HEADLAB" reproduce "$name" "$@" || { echo "reproduction $name failed" >&2; status=1; }
  "$HEADLAB" report "outputs/reproduce/$name" || status=1
done
exit $status
