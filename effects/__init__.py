"""The fenced side-effect boundary (installed as ``orchestrator.effects``)."""
