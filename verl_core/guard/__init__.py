"""Training stability (docs/guard.md).

- ``detectors``: anomaly detectors on robust statistics over recent steps;
- ``checks``: which detectors judge what, and where (the update's deterministic decision vs the
  wall-clock watch of every phase);
- ``policy``: warn / retry_phase / skip_batch / rollback / halt, with escalation;
- ``events``: the event log in the run store;
- ``faults``: fault injection for tests and chaos drills (``VERL_FAULTS``).
"""
