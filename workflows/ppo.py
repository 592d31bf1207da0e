"""RL post-training as cached Flyte phases: ``pyflyte run workflows/ppo.py ppo``.

    ppo  ->  configure -> prepare -> rl_run
    rl_run (dynamic)  ->  evaluate(start) -> train_chunk x ceil(steps / CHUNK) -> evaluate(end)
                          -> finalize        (no evaluate(start) with val_before_train=False)
    train_chunk (dynamic)  ->  per step: rollout -> reward -> advantage -> update
                               (-> checkpoint where one may be due: phases.checkpoint_follows)
                               (-> evaluate after every ``eval_every``-th step)

Iterations are unrolled in chunks of CHUNK steps (5 nodes each), so no dynamic workflow has more
than about 50 nodes, which keeps the same workflow within a Flyte cluster's limits. Re-running the
same command skips every phase that finished (the cache is the controller's memory).
"""

from flytekit import LaunchPlan, dynamic, workflow

from workflows._cli import add_dashed_aliases, one_line_errors

from tasks.advantage import advantage
from tasks.finalize import Summary
from tasks.phases import heavy_phases
from tasks.prepare import configure, prepare
from tasks.reward import reward
from verl_core.phases import checkpoint_follows
from verl_core.types import RunSpec, StepState

add_dashed_aliases()
one_line_errors()

CHUNK = 10
"""RL steps per sub-workflow (at most 5 nodes per step)."""


@dynamic
def train_chunk(spec: RunSpec, state: StepState, stop: int) -> StepState:
    every = spec.config.eval_every  # verl's trainer.test_freq; the last step is rl_run's end eval
    heavy = heavy_phases(spec)  # Ray tasks (cluster.mode=per_task) or attached plain tasks
    for k in range(state.step, stop):
        sampled = heavy.rollout(spec=spec, state=state)
        scored = reward(spec=spec, rollout=sampled)
        advantaged = advantage(spec=spec, scored=scored)
        state = heavy.update(spec=spec, advantaged=advantaged)
        # a checkpoint node where one may be due (the worker decides with the clock); elsewhere
        # the update ends the step (no node that only answers "not now")
        if checkpoint_follows(spec, k + 1):
            state = heavy.checkpoint(spec=spec, state=state)
        if every and (k + 1) % every == 0 and k + 1 < spec.total_steps:
            heavy.evaluate(spec=spec, state=state)
    return state


@dynamic
def rl_run(spec: RunSpec) -> Summary:
    heavy = heavy_phases(spec)
    start = StepState(step=spec.start_step)
    # verl's trainer.val_before_train=False: no node at all (not a node that answers "skipped"),
    # so finalize's cache key holds None for it and a re-run hits the same entries
    start_eval = heavy.evaluate(spec=spec, state=start) if spec.config.val_before_train else None
    state = start
    for k0 in range(spec.start_step, spec.total_steps, CHUNK):
        state = train_chunk(spec=spec, state=state, stop=min(k0 + CHUNK, spec.total_steps))
    end_eval = heavy.evaluate(spec=spec, state=state)
    return heavy.finalize(spec=spec, last=state, start=start_eval, end=end_eval)


@workflow
def ppo(algorithm: str = "", model: str = "", train_files: str = "", val_files: str = "",
        steps: int = 0, batch_size: int = 0, rollout_n: int = 0, run_name: str = "default",
        store: str = "", overrides: str = "", verl_config: str = "") -> Summary:
    """Train a causal LM with RL: configure, prepare, then the RL steps as cached phases.

    Re-running the same command skips every phase that finished. Algorithms: docs/algorithms.md;
    config keys: docs/options.md and docs/verl-keys.md.

    Args:
        algorithm: grpo, ppo (GAE + critic) or any advantage estimator registered in
            verl_core/algorithms (docs/algorithms.md lists them); "" = grpo, or
            verl's default gae (ppo) with a verl_config or verl's keys in overrides
        model: local Hugging Face folder; "" = a tiny Llama-style model, warm-started on the
            synthetic arithmetic task
        train_files: comma-separated parquet files in verl's row layout; "" = the synthetic
            arithmetic task
        val_files: comma-separated held-out parquet files; "" = the synthetic task's held-out
            split (none when train_files is given)
        steps: RL steps; 0 = the preset's (240)
        batch_size: prompts per RL step; 0 = the preset's (64)
        rollout_n: samples per prompt; 0 = the preset's (grpo 8, ppo 4)
        run_name: the run's folder in the store; the same name continues the same run
        store: local folder or s3://bucket/prefix holding the runs; "" = $VERL_STORE, else
            ./runs under the current folder
        overrides: JSON object of dotted config keys, ours or verl's, e.g. '{"optim.lr": 1e-4}'
            or '{"actor_rollout_ref.actor.optim.lr": 1e-6}' (docs/verl-keys.md); "" = none
        verl_config: a local verl YAML config file, read by configure (overrides win over it);
            "" = none
    """
    spec = configure(algorithm=algorithm, model=model, train_files=train_files,
                     val_files=val_files, steps=steps, batch_size=batch_size, rollout_n=rollout_n,
                     run_name=run_name, store=store, overrides=overrides, verl_config=verl_config)
    return rl_run(spec=prepare(spec=spec))


ppo_smoke = LaunchPlan.get_or_create(
    workflow=ppo, name="ppo_smoke",
    default_inputs={"steps": 3, "run_name": "smoke"},
)
"""A 3-step launch plan for checking a cluster deployment end to end."""
