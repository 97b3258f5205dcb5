#!/usr/bin/env bash
# The test command from the README: set up .venv with the test extras, then run
# the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh --test
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "tests/run.sh: pytest collected no tests; that is a failure here" >&2
  exit 1
fi
exit "$rc"
