"""W real processes over gloo for the tests that compare W = 2 with one process: each runs a
test module's worker function, ``fn(rank, world, init_method, *args)``, in a fresh Python with
one thread, joined over a ``file://`` rendezvous (no port to collide on)."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_gloo_workers(module: str, fn: str, tmp_path, *args: str, world: int = 2,
                     timeout_s: float = 300.0) -> None:
    """``module.fn(rank, world, "file://<tmp_path>/pg", *args)`` in ``world`` processes; fails
    with every worker's output when one exits non-zero. ``module``: its dotted name from the
    repository root (``tests.verl_core.training.test_dynamic_bsz``)."""
    code = (f"import sys; from {module} import {fn} as f; "
            "f(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])")
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(world),
                               f"file://{tmp_path / 'pg'}", *map(str, args)],
                              env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs


def finish() -> None:
    """A worker's last call: every rank done with its collectives before any rank tears the group
    down and exits (without the barrier, one rank destroyed its group and exited while the other
    was still finishing: that one died in ``std::terminate`` at exit, once, in CI under load).
    Exits the process with status 0: call it last."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    # and the process ends here: the worker wrote its results before this call, and the
    # interpreter's own teardown is where a thread left joinable by gloo still aborted in
    # std::terminate (once more in CI under load, after the barrier was added)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
