"""Flyte workflows: readable DAGs of the phase tasks (no tensor code, no config derivation)."""
