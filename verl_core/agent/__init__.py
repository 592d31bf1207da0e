"""Multi-turn, tool-calling rollouts (issue 25): verl's agent-loop contract. Light on purpose: the
tool host's child process imports this package, not torch or the rollout engines."""
