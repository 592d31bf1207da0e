"""Training stability: fault injection (more to come: anomaly detectors, recovery policies)."""
