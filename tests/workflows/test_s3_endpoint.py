"""One set of store options everywhere (issue 21 item 6): the S3 recipe of docs/cluster.md sets only
``VERL_S3_ENDPOINT`` (keys in AWS_* variables), and every fsspec call of a run must reach that
server: the phases, finalize's export and metrics table, data files, the CLI and the probe.

Before the fix ``RunStore.storage_options`` kept the caller's raw options (no endpoint), so
finalize's ``url_to_fs(final_uri, **st.storage_options)`` went to AWS's default endpoint."""
import ast
import json
import pathlib
import subprocess
import sys

import pytest

from tests.workflows.conftest import REPO, flyte_env, ppo_cmd, run
from verl_core.store import RunStore, resolve_storage_options

FS_BUILDERS = {"url_to_fs", "open", "filesystem", "open_files", "get_mapper"}


def _fsspec_calls(tree: ast.AST):
    """Calls that build an fsspec filesystem: ``fsspec.open(...)``, ``fsspec.filesystem(...)``,
    ``fsspec.core.url_to_fs(...)`` and friends (not the builtin ``open`` or ``fs.open``)."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        chain = []
        v = f.value
        while isinstance(v, ast.Attribute):
            chain.append(v.attr)
            v = v.value
        if isinstance(v, ast.Name):
            chain.append(v.id)
        if f.attr in FS_BUILDERS and chain and chain[-1] == "fsspec":
            yield node


def _resolved(node: ast.Call) -> bool:
    """The call's ``**options`` are resolved: ``resolve_storage_options(url, ...)``, or a
    RunStore's ``.storage_options`` (resolved by its constructor: checked below)."""
    for kw in node.keywords:
        if kw.arg is None:
            v = kw.value
            if isinstance(v, ast.Call) and getattr(v.func, "id", None) == "resolve_storage_options":
                return True
            if isinstance(v, ast.Attribute) and v.attr == "storage_options":
                return True
    return False


def test_every_fsspec_call_of_the_library_uses_the_resolved_options():
    """A static check over verl_core/, tasks/ and workflows/: a new fsspec call built from raw
    options would reach AWS instead of VERL_S3_ENDPOINT. store/run_store.py is where they are
    resolved."""
    found, bad = 0, []
    for top in ("verl_core", "tasks", "workflows"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == "verl_core/store/run_store.py":
                continue
            for node in _fsspec_calls(ast.parse(path.read_text(), rel)):
                found += 1
                if not _resolved(node):
                    bad.append(f"{rel}:{node.lineno}")
    assert found >= 5  # the scan sees the calls (datasets, assets, finalize, probe, export)
    assert not bad, ("fsspec calls without resolve_storage_options(url, opts) or a RunStore's "
                     f"storage_options: {bad}")


def test_a_stores_options_carry_the_endpoint_and_resolving_is_idempotent(monkeypatch):
    monkeypatch.setenv("VERL_S3_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    st = RunStore("s3://bkt/runs/t", create=False)  # builds the filesystem, sends nothing
    assert st.storage_options["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9"
    assert resolve_storage_options(st.uri, st.storage_options) == st.storage_options
    assert resolve_storage_options("s3://other/x") == st.storage_options  # same service
    explicit = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:10"}}
    assert (resolve_storage_options("s3://b", explicit)["client_kwargs"]["endpoint_url"]
            == "http://127.0.0.1:10")  # the caller's choice wins
    assert resolve_storage_options("/tmp/x", {"auto_mkdir": True}) == {"auto_mkdir": True}


@pytest.mark.slow
def test_the_readme_s3_recipe_runs_end_to_end_against_the_configured_server(moto_s3_readme,
                                                                           tmp_path):
    """`pyflyte run ... --store s3://<bucket>/runs` with only VERL_S3_ENDPOINT (and AWS_* keys)
    set: the run finishes, and its final model, metrics table and checkpoints are on the loopback
    server (nothing can reach AWS from here: a call that went there would fail the run, as
    finalize's did before the fix). The checkpoint CLI and the probe find them the same way."""
    import boto3
    import fsspec
    import pandas as pd

    endpoint, bucket = moto_s3_readme
    env = flyte_env(tmp_path)  # inherits VERL_S3_ENDPOINT and the AWS_* keys of the fixture
    assert env["VERL_S3_ENDPOINT"] == endpoint and "AWS_ENDPOINT_URL" not in env
    store = f"s3://{bucket}/runs"
    out = run(ppo_cmd(store, steps=2), env, timeout=900)
    summary = [ln for ln in out.stdout.splitlines() if ln.startswith("Summary(")][-1]
    final = summary.split("final_model='", 1)[1].split("'", 1)[0]
    table = summary.split("metrics_table='", 1)[1].split("'", 1)[0]
    assert final.startswith(f"{store}/t/exports/") and table.startswith(f"{store}/t/metrics/")

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys = {o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])}
    prefix = final[len(f"s3://{bucket}/"):]
    assert {f"{prefix}/config.json", f"{prefix}/model.safetensors"} <= keys
    assert table[len(f"s3://{bucket}/"):] in keys
    with fsspec.open(table, "rb", **resolve_storage_options(table)) as f:
        assert pd.read_parquet(f)["step"].tolist() == [0, 1, 2]

    cli = subprocess.run([sys.executable, "-m", "verl_core.checkpoint", "list", f"{store}/t"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and "step        2" in cli.stdout, cli.stdout + cli.stderr
    probe = subprocess.run([sys.executable, "-m", "verl_core", "health"], cwd=REPO,
                           env={**env, "VERL_STORE": f"{store}/t"}, capture_output=True,
                           text=True, timeout=300)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert json.loads(probe.stdout)["checks"]["store"]["ok"]
