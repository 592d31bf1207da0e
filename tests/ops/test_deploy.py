"""deploy/ validated offline: built-in kinds against the Kubernetes schemas bundled by
kubernetes-validate, the RayCluster against KubeRay's vendored CRD schema, the flyte-binary values
against what the Ray plugin needs, and every liveness probe command run here."""
import copy
import functools
import os
import pathlib
import shlex
import subprocess
import sys
import time

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CRD = DEPLOY / "schemas/kuberay-v1.7.0/ray.io_rayclusters.yaml"
K8S_VERSIONS = ("1.31.0", "1.37.0")  # the oldest and newest Kubernetes the manifests target


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def _strict(schema):
    """The CRD schema with ``additionalProperties: false`` on every object that lists its
    properties (unless it preserves unknown fields). kubectl's default strict field validation
    rejects unknown fields; plain JSON Schema would accept a misspelled key silently."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return schema


@functools.cache
def _raycluster_validator():
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_strict(v1["schema"]["openAPIV3Schema"]))


def _validate(doc: dict) -> None:
    if doc["apiVersion"] == "ray.io/v1":
        assert doc["kind"] == "RayCluster", doc["kind"]
        _raycluster_validator().validate(doc)
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_every_manifest_validates():
    docs = _docs()
    kinds = {d["kind"] for _, d in docs}
    assert {"RayCluster", "PodTemplate", "PersistentVolumeClaim", "PersistentVolume",
            "Secret"} <= kinds, kinds
    for name, doc in docs:
        try:
            _validate(doc)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as e:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {e}")


@pytest.mark.parametrize("kind,mutate,error", [
    ("RayCluster", lambda d: d["spec"].update(workerGroupSpec=[]), jsonschema.ValidationError),
    ("RayCluster", lambda d: d["spec"]["workerGroupSpecs"][0].update(replicas="two"),
     jsonschema.ValidationError),
    ("RayCluster", lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     .update(livenesProbe={}), jsonschema.ValidationError),
    ("PodTemplate", lambda d: d["template"]["spec"]["containers"][0].update(livenesProbe={}),
     kubernetes_validate.ValidationError),
    ("PersistentVolumeClaim", lambda d: d["spec"].update(accessModes="ReadWriteMany"),
     kubernetes_validate.ValidationError),
])
def test_the_validation_rejects_mistakes(kind, mutate, error):
    """The validators are strict enough to catch a misspelled field or a wrong type."""
    (doc,) = [copy.deepcopy(d) for _, d in _docs() if d["kind"] == kind]
    mutate(doc)
    with pytest.raises(error):
        _validate(doc)


def _containers(doc: dict):
    if doc["kind"] == "PodTemplate":
        yield from doc["template"]["spec"]["containers"]
    elif doc["kind"] == "RayCluster":
        yield from doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
        for group in doc["spec"]["workerGroupSpecs"]:
            yield from group["template"]["spec"]["containers"]


def _pod_specs(doc: dict):
    if doc["kind"] == "PodTemplate":
        yield doc["template"]["spec"]
    elif doc["kind"] == "RayCluster":
        yield doc["spec"]["headGroupSpec"]["template"]["spec"]
        for group in doc["spec"]["workerGroupSpecs"]:
            yield group["template"]["spec"]


def test_references_resolve_and_gpu_workers_are_placed_on_gpu_nodes():
    docs = [d for _, d in _docs()]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for doc in docs:
        for spec in _pod_specs(doc):
            for vol in spec.get("volumes", []):
                if "persistentVolumeClaim" in vol:
                    claim = vol["persistentVolumeClaim"]["claimName"]
                    assert ("PersistentVolumeClaim", claim) in names, claim
            mounted = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
            assert mounted <= {v["name"] for v in spec.get("volumes", [])}, mounted
        for c in _containers(doc):
            for ref in c.get("envFrom", []):
                assert ("Secret", ref["secretRef"]["name"]) in names
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert ("PersistentVolume", pvc["spec"]["volumeName"]) in names
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    for group in cluster["spec"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        (c,) = spec["containers"]
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        exprs = [e for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]]
        assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in exprs
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])


def test_flyte_binary_values_enable_the_ray_plugin_with_its_rbac():
    values = yaml.safe_load((DEPLOY / "helm/flyte-binary-values.yaml").read_text())
    inline = values["configuration"]["inline"]
    plugins = inline["tasks"]["task-plugins"]
    # the chart's own plugins (flyte-binary v1.16 values.yaml) stay enabled, plus ray
    assert {"container", "sidecar", "k8s-array", "ray"} <= set(plugins["enabled-plugins"])
    assert plugins["default-for-task-types"]["ray"] == "ray"
    from tasks.rollout import rollout

    assert rollout.task_type in plugins["default-for-task-types"]
    # the default PodTemplate is the one in deploy/k8s
    template = inline["plugins"]["k8s"]["default-pod-template-name"]
    assert ("PodTemplate", template) in {(d["kind"], d["metadata"]["name"]) for _, d in _docs()}
    # the RBAC rules are valid ClusterRole rules and let the plugin manage RayJobs
    rules = values["rbac"]["extraRules"]
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "flyte-binary-extra"}, "rules": rules}
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(role, version, strict=True)
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    for verb in ("create", "get", "list", "watch", "update", "patch", "delete"):
        assert ("ray.io", "rayjobs", verb) in granted, verb


def _probes():
    for name, doc in _docs():
        for c in _containers(doc):
            if "livenessProbe" in c:
                yield f"{name}:{c['name']}", c


def test_every_liveness_probe_command_runs_and_fails_on_a_hung_phase(tmp_path):
    """Each probe's exec command, run here with its container's environment (mount paths moved
    under tmp_path): exit 0 while healthy; where the pod has a heartbeat, non-zero once the
    heartbeat is older than VERL_HEARTBEAT_MAX_AGE_S (a phase that hangs)."""
    probes = list(_probes())
    assert {p.split(":")[0] for p, _ in probes} == {"pod-template.yaml", "raycluster.yaml"}
    with_heartbeat, seen = 0, set()
    for where, c in probes:
        cmd = c["livenessProbe"]["exec"]["command"]
        assert cmd[0] == "python", (where, cmd)
        key = (tuple(cmd), repr(c.get("env")))
        if key in seen:  # the same command in the same environment (head and workers)
            continue
        seen.add(key)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
        local = {}
        for e in c.get("env", []):
            value = e["value"]
            if value.startswith("/"):  # a path in the pod: move it under tmp_path
                value = str(tmp_path / where.replace(":", "-") / value.lstrip("/"))
            local[e["name"]] = value
        env.update(local)

        def probe():
            return subprocess.run([sys.executable, *cmd[1:]], env=env, capture_output=True,
                                  text=True, timeout=c["livenessProbe"]["timeoutSeconds"] + 60)

        ok = probe()
        assert ok.returncode == 0, (where, shlex.join(cmd), ok.stdout, ok.stderr)
        if "VERL_HEARTBEAT_FILE" in local:
            with_heartbeat += 1
            import verl_core

            hb = local["VERL_HEARTBEAT_FILE"]
            verl_core.beat(hb)  # a phase started ...
            assert probe().returncode == 0
            old = time.time() - float(local["VERL_HEARTBEAT_MAX_AGE_S"]) - 5  # ... and hung
            os.utime(hb, (old, old))
            hung = probe()
            assert hung.returncode == 1 and "heartbeat age" in hung.stdout, (where, hung.stdout)
            if "VERL_STORE" in local:
                assert '"store"' in ok.stdout  # the store round trip ran too
    assert with_heartbeat == 1  # the phase pods' template
