"""The calls from the workflow's update node to the loss, as they run (issue 24's hop count).

Runs one real step of the tiny default run through the phase tasks' own functions in this
process (configure, prepare, rollout, reward, advantage, then update), with the run's worker
in-process (Ray, which prepare starts, is shut down first: on Ray the same frames run, split
between the driver and the worker's actor, plus Ray's transport), and records the Python stack at
the call of the registered policy loss. Prints every frame from the update task's function down
to the loss, one a line, numbered: the hops. It reads the checkout it is given, so the same
command measures any commit:

    python bench/call_path.py            # this checkout
    python bench/call_path.py /tmp/old   # another checkout (a clone at an older commit)
"""

from __future__ import annotations

import os
import sys
import tempfile

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.chdir(ROOT)



def _frame_name(frame) -> str:
    path = os.path.relpath(frame.f_code.co_filename, ROOT)
    return f"{path}:{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}"


def main() -> None:
    from tasks.advantage import advantage
    from tasks.prepare import configure, prepare
    from tasks.reward import reward
    from tasks.rollout import rollout
    from tasks.update import update
    from verl_core.algorithms import POLICY_LOSSES

    losses = {POLICY_LOSSES.get(name).__code__ for name in POLICY_LOSSES.names()}

    state_type = rollout.python_interface.inputs["state"]
    with tempfile.TemporaryDirectory(prefix="verl-call-path-") as store:
        spec = configure.task_function(
            algorithm="", model="", train_files="", val_files="", steps=1, batch_size=0,
            rollout_n=0, run_name="path", store=store, overrides="", verl_config="")
        spec = prepare.task_function(spec=spec)
        import ray

        ray.shutdown()  # the run's worker in this process (the same frames as on Ray)
        sampled = rollout.task_function(spec=spec, state=state_type(step=0))
        scored = reward.task_function(spec=spec, rollout=sampled)
        advantaged = advantage.task_function(spec=spec, scored=scored)

        top = update.task_function.__code__
        found: list[list[str]] = []

        def profile(frame, event, arg):
            if event != "call" or found or frame.f_code not in losses:
                return
            stack, f = [], frame
            while f is not None and f.f_code is not top:
                stack.append(_frame_name(f))
                f = f.f_back
            if f is not None:
                found.append([_frame_name(f)] + stack[::-1])

        sys.setprofile(profile)
        try:
            update.task_function(spec=spec, advantaged=advantaged)
        finally:
            sys.setprofile(None)
    if not found:
        raise SystemExit("the update never called a registered policy loss")
    frames = found[0]
    print(f"frames from the update task to the loss ({ROOT}):")
    for i, name in enumerate(frames):
        print(f"  {i:2d}  {name}")
    print(f"calls: {len(frames) - 1}")


if __name__ == "__main__":
    main()
