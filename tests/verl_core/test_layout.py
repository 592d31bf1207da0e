"""The run store's names, pinned to their literal strings: a stored run stays readable only if
every name the layout builds stays as it was (these are the names of stores written before
``verl_core/layout.py`` existed)."""
from verl_core import layout

H = "0123456789abcdef" * 4  # a trajectory hash (64 hex)
SHA = "f" * 64


def test_short_hash_rule():
    assert layout.short_hash(H) == "0123456789abcdef"
    assert layout.short_hash(H, layout.LABEL_CHARS) == "0123456789ab"


def test_per_trajectory_names_are_unchanged():
    assert layout.lineage_doc(H, 7) == "lineage/0123456789abcdef/000000007"
    assert layout.pending_doc(H, 3, "reward") == "pending/0123456789abcdef/000000003-reward"
    assert layout.eval_samples_doc(H, 12) == "eval-samples/0123456789abcdef/000000012"
    assert layout.report_doc(H, 2, "advantage") == \
        "validation/0123456789abcdef/000000002-advantage"
    assert layout.event_folder(H) == "events/0123456789abcdef"
    assert layout.metrics_log(H) == "metrics-0123456789abcdef"
    assert layout.export_path(H, 16) == "exports/0123456789ab-step000016"
    assert layout.metrics_table_path(H) == "metrics/0123456789ab.parquet"
    assert layout.asset_record_doc(H) == f"assets/trajectories/{H}"


def test_store_wide_names_are_unchanged():
    assert layout.checkpoint_doc(layout.checkpoint_name(4, SHA)) == f"checkpoints/000000000004-{SHA}"
    assert layout.group_doc("ref") == "shared/groups/ref"
    assert layout.inflight_doc("ab12") == "inflight/ab12"
    assert layout.asset_index_doc(SHA) == f"assets/{SHA}"
    assert layout.warm_start_doc(SHA) == f"assets/warmstart/{SHA}"  # under a gc root folder
    assert (layout.LEASE_DOC, layout.LATEST_DOC, layout.COMPUTE_DOC, layout.TOKENIZER_DOC) == \
        ("lease", "latest", "compute", "shared/tokenizer")
    assert (layout.PHASE_LOG, layout.CHECKPOINT_LOG) == ("phases", "checkpoints")
    assert layout.BEST_DOC == "best"
    assert layout.GC_ROOT_FOLDERS == ("assets", "lineage", "pending", "shared", "staging")
