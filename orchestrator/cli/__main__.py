"""``python -m orchestrator.cli``: the ``orchestrator`` command, as tests and the demo spawn it."""

from orchestrator.cli import main

main()
