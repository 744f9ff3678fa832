#!/usr/bin/env bash
# Run coserve's test suite (sets up first if needed). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
# The dashboard test drives Debian's Chromium through Playwright (never a downloaded browser).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "[test] could not install chromium; the dashboard browser test will be skipped"
fi
# The PostgreSQL test runs a throwaway cluster from Debian's binaries (skipped without them).
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) \
    || echo "[test] could not install postgresql; the PostgreSQL test will be skipped"
fi
# Two test processes (pytest-xdist), a test file each at a time: most of a test's time is spent waiting on the
# worker, engine and HTTP processes it starts, so two halve the wall time even on two cores (four gain nothing
# more there). The heaviest files go first (tests/file_order.py), in that order rather than xdist's (most tests first),
# so neither process is left with a long file while the other idles. COSERVE_TEST_PROCESSES=0 runs it in this
# process; a later -n in the arguments wins.
# Bytecode is cached even where the environment says not to: each test process rewrites every test module's asserts
# and each worker or server process the tests start compiles coserve again otherwise (collection: 25 s -> 16 s).
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${COSERVE_TEST_PROCESSES:-2}" --dist loadfile \
  --no-loadscope-reorder "$@"
