"""Every workflow serializes offline (what a Flyte cluster registration needs)."""
import subprocess
import tarfile

from conftest import PYFLYTE, REPO, flyte_env


def test_pyflyte_package_offline(tmp_path):
    out = tmp_path / "flyte-package.tgz"
    # the Ray tasks run in the `gpu` image (tasks/images.py): registration names both
    res = subprocess.run([PYFLYTE, "--pkgs", "workflows", "package",
                          "--image", "localhost/verl-flyte:latest",
                          "--image", "gpu=localhost/verl-flyte-gpu:latest",
                          "-o", str(out), "--force"],
                         cwd=REPO, env=flyte_env(tmp_path), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    names = " ".join(tarfile.open(out).getnames())
    for entity in ("tasks.rollout.rollout", "tasks.reward.reward", "tasks.advantage.advantage",
                   "tasks.update.update", "tasks.checkpoint.checkpoint", "tasks.prepare.prepare",
                   "workflows.ppo.ppo", "workflows.ppo.train_chunk", "ppo_smoke",
                   "tasks.schedule.continuation_steps", "workflows.schedules.ppo_continue",
                   "workflows.schedules.evaluate_newest", "ppo_nightly", "eval_newest"):
        assert entity in names, (entity, names)


def test_phase_tasks_are_cached_retried_and_ray(tmp_path):
    import verl_core
    from tasks.rollout import rollout
    from tasks.reward import reward
    from tasks.update import update

    for t in (rollout, reward, update):
        assert t.metadata.cache and t.metadata.retries == 3
        assert t.metadata.cache_version.startswith(verl_core.__version__)
    assert rollout.task_type == "ray" and update.task_type == "ray"
