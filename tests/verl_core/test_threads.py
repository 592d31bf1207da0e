"""The intra-op thread count is fixed for a run: resolved at its first prepare, recorded in its
store, and the same on every later prepare, whatever the host (issue 21 item 8)."""
import json

import pytest

from verl_core import threads
from verl_core.config import ConfigError, RunConfig, with_overrides
from verl_core.prepare import prepare_run
from verl_core.errors import CorruptObjectError
from verl_core.store import RunStore


def _cfg(**over) -> RunConfig:
    return with_overrides(RunConfig(), over)


def test_the_first_prepare_records_the_count_and_other_hosts_reuse_it(tmp_path, monkeypatch):
    st = RunStore(str(tmp_path / "run"))
    monkeypatch.setattr(threads, "host_cpus", lambda: 6)
    first = threads.pin_num_threads(st, _cfg())
    assert first.num_threads == 6  # 6 CPUs, one worker
    assert json.loads((tmp_path / "run" / "compute.json").read_text())["num_threads"] == 6
    # a rebuild on a pod with 2 CPUs, or in a Ray actor that Ray gave one thread: the same count,
    # so the same config (and spec literal: every cache key) as on the first host
    monkeypatch.setattr(threads, "host_cpus", lambda: 2)
    again = threads.pin_num_threads(RunStore(str(tmp_path / "run")), _cfg())
    assert again == first and again.trajectory_hash() == RunConfig().trajectory_hash()
    assert threads.pin_num_threads(st, _cfg(num_threads=6)) == first  # the same count: fine


def test_the_default_shares_the_cpus_between_the_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "host_cpus", lambda: 5)
    two = _cfg(**{"trainer.n_gpus_per_node": 2})
    assert threads.intra_op_threads(two) == 2  # 5 // 2
    assert threads.pin_num_threads(RunStore(str(tmp_path / "a")), two).num_threads == 2
    monkeypatch.setattr(threads, "host_cpus", lambda: 1)
    assert threads.intra_op_threads(_cfg(**{"trainer.n_gpus_per_node": 4})) == 1  # at least 1
    assert threads.intra_op_threads(_cfg(num_threads=3)) == 3  # a resolved config: its count


def test_an_explicit_count_is_recorded_and_another_one_is_refused(tmp_path):
    st = RunStore(str(tmp_path / "run"))
    assert threads.pin_num_threads(st, _cfg(num_threads=3)).num_threads == 3
    assert threads.pin_num_threads(st, _cfg()).num_threads == 3  # 0: the recorded count
    with pytest.raises(ConfigError, match=r"run.num_threads=1: this run computes with 3 intra-op "
                                          r"threads per worker \(recorded .*compute.json\).*Leave "
                                          r"num_threads at 0 \(or 3\).*new --run-name"):
        threads.pin_num_threads(st, _cfg(num_threads=1))


def test_prepare_refuses_another_count_before_any_work(tmp_path):
    st = RunStore(str(tmp_path / "store" / "r"))
    st.put_json("compute", {"num_threads": 3})
    with pytest.raises(ConfigError, match="run.num_threads=1: this run computes with 3"):
        prepare_run(_cfg(num_threads=1), str(tmp_path / "store"), "r",
                            log_fn=lambda *_: None)
    assert not (tmp_path / "store" / "r" / "assets").exists()  # nothing copied


@pytest.mark.parametrize("doc", [b'{"num_threads": 0}', b'{"num_threads": "2"}', b"[1]",
                                 b'{"num_thr'])
def test_a_damaged_record_is_named(tmp_path, doc):
    st = RunStore(str(tmp_path / "run"))
    (tmp_path / "run" / "compute.json").write_bytes(doc)
    with pytest.raises(CorruptObjectError, match="compute.json"):
        threads.pin_num_threads(st, _cfg())
