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
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
