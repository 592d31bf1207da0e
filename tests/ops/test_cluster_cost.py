"""bench/cluster_cost.py's model of orchestration on a cluster (issue 43 item 2): its arithmetic
on a hand-computed case. Pure functions only: nothing is measured or launched."""
import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "cluster_cost", Path(__file__).resolve().parents[2] / "bench" / "cluster_cost.py")
cc = importlib.util.module_from_spec(_spec)
sys.modules["cluster_cost"] = cc  # dataclasses look their module up there
_spec.loader.exec_module(cc)

GB = 1e9
# 30 s pods, 150 tasks/min (0.4 s each), 60 s RayJobs, 1 s reusable, 10 GB/s, 0.1 s per request
CLUSTER = cc.Cluster(pod_start_s=30, tasks_per_min=150, rayjob_start_s=60, reusable_start_s=1,
                     store_gb_s=10, store_request_s=0.1)
# heavy phases per step: rollout + update + 1/10 checkpoint + 0 evaluations = 2.1; light 2
# a rebuild: 20 GB at 10 GB/s = 2 s, plus 3 s of build = 5 s
# batches: (1 + 1 + 2) GB written and read = 8 GB at 10 GB/s = 0.8 s, + 6 requests x 0.1 s,
# + 0.2 s of encoding = 1.6 s
WORK = cc.Workload("hand", step_s=100, total_steps=10, checkpoint_interval=10, evals_per_run=0,
                   state_bytes=20 * GB, state_build_s=3, warm_check_s=0.01, process_s=5,
                   batch_bytes=(1 * GB, 1 * GB, 2 * GB), batch_codec_s=0.2)


def test_phase_counts_and_batch_io():
    assert WORK.heavy_per_step == pytest.approx(2.1)
    assert WORK.batch_bytes_per_step == 8 * GB
    assert cc.batch_io_s(WORK, CLUSTER) == pytest.approx(0.8 + 0.6 + 0.2)


def test_per_task():
    k = cc.cost("per_task", WORK, CLUSTER)
    assert k.scheduling_s == pytest.approx(4.1 * 0.4)  # 4.1 task executions at 0.4 s
    # 2 light pods x 30 s + 2.1 RayJobs x 60 s + 4.1 fresh processes x 5 s = 60 + 126 + 20.5
    assert k.pod_start_s == pytest.approx(206.5)
    assert k.state_load_s == pytest.approx(2.1 * 5)  # a rebuild per heavy phase
    assert k.batch_io_s == pytest.approx(1.6)
    # per_task total = light x (pod + process) + heavy x (RayJob + process + rebuild)
    #                  + scheduling + batch I/O
    assert k.total_s == pytest.approx(2 * 35 + 2.1 * (65 + 5) + 1.64 + 1.6) == 220.24
    assert k.bytes == pytest.approx(2.1 * 20 * GB + 8 * GB)  # 50 GB
    assert k.share(WORK.step_s) == pytest.approx(220.24 / 320.24)


def test_attached():
    k = cc.cost("attached", WORK, CLUSTER)
    assert k.pod_start_s == pytest.approx(4.1 * 35)  # every task still a pod and a process
    assert k.state_load_s == pytest.approx(2.1 * 0.01)  # warm workers: a version check
    assert k.total_s == pytest.approx(1.64 + 143.5 + 0.021 + 1.6)
    assert k.bytes == 8 * GB  # the batches only


def test_flyte2_driver_built_a_task_per_phase_in_a_pod_or_a_reusable_container():
    w = cc.dataclasses.replace(WORK, dispatch_s=0.05)  # the driver's local cost per phase task
    k = cc.cost("flyte2_driver", w, CLUSTER)
    assert k.scheduling_s == pytest.approx(4.1 * (0.05 + 0.1))  # dispatch + its record
    # one driver pod + process per 10-step run, and a pod + process per phase task
    assert k.pod_start_s == pytest.approx(35 / 10 + 4.1 * 35)
    assert k.state_load_s == pytest.approx(0.021 + 5 / 10)  # one rebuild per run
    assert k.bytes == pytest.approx(20 * GB / 10 + 8 * GB)
    r = cc.cost("flyte2_reusable", w, CLUSTER)
    assert r.pod_start_s == pytest.approx(35 / 10 + 4.1 * 1)  # a warm container per phase task
    assert r.total_s == pytest.approx(4.1 * 0.15 + 3.5 + 4.1 + 0.521 + 1.6)
    assert "flyte2_reusable" in cc.BUILT and "flyte2_traced" not in cc.BUILT


def test_flyte2_traced_and_attached_reusable():
    k = cc.cost("flyte2_traced", WORK, CLUSTER)
    assert k.scheduling_s == pytest.approx(4.1 * 0.1)  # a trace record per phase
    assert k.pod_start_s == pytest.approx(35 / 10)  # one driver pod + process per 10-step run
    assert k.state_load_s == pytest.approx(0.021 + 5 / 10)  # one rebuild per run
    assert k.total_s == pytest.approx(0.41 + 3.5 + 0.521 + 1.6)
    assert k.bytes == pytest.approx(20 * GB / 10 + 8 * GB)
    r = cc.cost("attached_reusable", WORK, CLUSTER)
    assert r.pod_start_s == pytest.approx(4.1 * 1)
    assert r.total_s == pytest.approx(1.64 + 4.1 + 0.021 + 1.6)


def test_unknown_setup_names_the_known_ones():
    with pytest.raises(ValueError, match="per_task"):
        cc.cost("serverless", WORK, CLUSTER)
