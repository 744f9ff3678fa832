"""``python -m app.cli``: the ``coserve`` command from a checkout (no entry point installed for it)."""

from app.cli import main

main()
