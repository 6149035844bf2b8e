"""The Helm chart (helm/parwatch): lint, render, validate every manifest, and hold it to its promises.

Built-in kinds are validated offline with kubernetes-validate (strict schemas of Kubernetes 1.30,
the first minor after native sidecars went default-on). The custom resources it has no schemas for
(PodMonitor, PrometheusRule, TrainingRuntime, TrainJob) are checked structurally here, and the pod
and job templates embedded in the TrainingRuntime are validated as a Pod and a Job.

helm is found at $PARWATCH_HELM, .tools/bin/helm (scripts/install_helm.sh .tools/bin) or PATH;
tests that need it skip without it. The chart-copy checks run everywhere.
"""

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "parwatch"
K8S_VERSION = "1.30.0"
NAMESPACE = "ml"
RELEASE = "run1"
CONFIGS = {
    "default": [],
    "all-features": [CHART / "ci" / "all-features-values.yaml"],
    "trainjob": [CHART / "ci" / "trainjob-values.yaml"],
}
CRD_GROUPS = ("monitoring.coreos.com/", "trainer.kubeflow.org/")
STANDARD_LABELS = {
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
}
SELECTOR = {"app.kubernetes.io/name": "parwatch", "app.kubernetes.io/instance": RELEASE}


def find_helm() -> str | None:
    for candidate in (os.environ.get("PARWATCH_HELM"), str(ROOT / ".tools" / "bin" / "helm"), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def helm():
    path = find_helm()
    if path is None:
        pytest.skip("helm not found: run scripts/install_helm.sh .tools/bin, or set PARWATCH_HELM")
    return path


def run_helm(helm, *args):
    return subprocess.run([helm, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=ROOT)


def values_args(files=(), sets=()):
    args = []
    for f in files:
        args += ["-f", f]
    for s in sets:
        args += ["--set", s]
    return args


def render(helm, files=(), sets=()):
    proc = run_helm(helm, "template", RELEASE, CHART, "--namespace", NAMESPACE, *values_args(files, sets))
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def rendered(helm):
    return {name: render(helm, files) for name, files in CONFIGS.items()}


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def pod_specs(docs):
    """(where, pod template) of every workload: the Job's, and the TrainingRuntime's."""
    out = [("Job", j["spec"]["template"]) for j in of_kind(docs, "Job")]
    for rt in of_kind(docs, "TrainingRuntime"):
        for rj in rt["spec"]["template"]["spec"]["replicatedJobs"]:
            out.append((f"TrainingRuntime/{rj['name']}", rj["template"]["spec"]["template"]))
    assert out, "no workload rendered"
    return out


def container(pod, name, init=False):
    (c,) = [c for c in pod["spec"]["initContainers" if init else "containers"] if c["name"] == name]
    return c


# --- the copies the chart carries ---------------------------------------------------------------


def test_chart_rules_are_the_packaged_default_rules():
    assert (CHART / "files" / "default_rules.yaml").read_bytes() == (
        ROOT / "parwatch" / "sidecar" / "default_rules.yaml"
    ).read_bytes(), "copy parwatch/sidecar/default_rules.yaml to helm/parwatch/files/default_rules.yaml"


def test_chart_dashboard_is_the_exported_dashboard():
    assert (CHART / "files" / "parwatch.json").read_bytes() == (ROOT / "dashboards" / "parwatch.json").read_bytes(), (
        "copy dashboards/parwatch.json to helm/parwatch/files/parwatch.json"
    )


def test_chart_alerts_are_the_rendered_alerts():
    source = ROOT / "dashboards" / "alerts.yaml"
    if not source.exists():
        pytest.skip("dashboards/alerts.yaml not rendered yet (parwatch rules render-alerts)")
    assert (CHART / "files" / "alerts.yaml").read_bytes() == source.read_bytes(), (
        "copy dashboards/alerts.yaml to helm/parwatch/files/alerts.yaml"
    )


def test_chart_recording_rules_are_the_rendered_recording_rules():
    assert (CHART / "files" / "recording_rules.yaml").read_bytes() == (
        ROOT / "dashboards" / "recording_rules.yaml"
    ).read_bytes(), "copy dashboards/recording_rules.yaml to helm/parwatch/files/recording_rules.yaml"


def test_values_schema_closes_every_object():
    def walk(node, path):
        if isinstance(node, dict):
            if "properties" in node:
                assert node.get("additionalProperties") is False, f"{path} accepts unknown keys"
            for key, sub in node.items():
                walk(sub, f"{path}.{key}")
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                walk(sub, f"{path}[{i}]")

    schema = json.loads((CHART / "values.schema.json").read_text())
    walk(schema, "$")
    # every top-level key of values.yaml is described by the schema
    assert set(yaml.safe_load((CHART / "values.yaml").read_text())) <= set(schema["properties"])


# --- lint and render ----------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
def test_lint_strict(helm, config):
    proc = run_helm(helm, "lint", "--strict", CHART, *values_args(CONFIGS[config]))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("config", CONFIGS)
def test_builtin_manifests_validate_strict(rendered, config):
    docs = rendered[config]
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 2


def test_trainingruntime_templates_validate_as_job_and_pod(rendered):
    (rt,) = of_kind(rendered["trainjob"], "TrainingRuntime")
    replicated = rt["spec"]["template"]["spec"]["replicatedJobs"]
    assert [rj["name"] for rj in replicated] == ["node"]  # one job per node: the trainer and its sidecar
    for rj in replicated:
        job_spec = rj["template"]["spec"]
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": rj["name"]},
            "spec": {**job_spec, "template": job_spec["template"]},
        }
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": job_spec["template"]["metadata"],
            "spec": {**job_spec["template"]["spec"], "restartPolicy": "Never"},
        }
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_default_render_has_only_the_core_objects(rendered):
    assert sorted(d["kind"] for d in rendered["default"]) == ["ConfigMap", "Job", "Secret", "Service"]  # + the token
    kinds = {d["kind"] for d in rendered["all-features"]}
    assert {"Job", "Service", "PodMonitor", "PrometheusRule"} <= kinds
    assert "Secret" not in kinds  # all-features uses an existing Secret
    assert {d["kind"] for d in rendered["trainjob"]} >= {"TrainJob", "TrainingRuntime", "Secret"}
    assert not of_kind(rendered["trainjob"], "Job") and not of_kind(rendered["trainjob"], "Service")


# --- labels -------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
def test_standard_labels_and_name_instance_selectors(rendered, config):
    docs = rendered[config]
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert STANDARD_LABELS <= set(labels), f"{doc['kind']} lacks {STANDARD_LABELS - set(labels)}"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert {k: labels[k] for k in SELECTOR} == SELECTOR
    for svc in of_kind(docs, "Service"):
        assert svc["spec"]["selector"] == SELECTOR
    for pm in of_kind(docs, "PodMonitor"):
        assert pm["spec"]["selector"] == {"matchLabels": SELECTOR}
    for where, pod in pod_specs(docs):
        assert SELECTOR.items() <= pod["metadata"]["labels"].items(), where
        assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "training"


def test_common_and_additional_labels_apply(rendered):
    docs = rendered["all-features"]
    assert all(d["metadata"]["labels"]["team"] == "ml-platform" for d in docs)
    for kind in ("PodMonitor", "PrometheusRule"):
        (obj,) = of_kind(docs, kind)
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"


# --- the sidecar --------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
def test_sidecar_is_a_restricted_native_sidecar(rendered, config):
    for where, pod in pod_specs(rendered[config]):
        sc = container(pod, "parwatch-sidecar", init=True)
        assert sc["restartPolicy"] == "Always", where
        ctx = sc["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] > 0
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["capabilities"]["drop"] == ["ALL"] and "add" not in ctx["capabilities"]
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
        # The state directory is the only writable path.
        writable = [m for m in sc["volumeMounts"] if not m.get("readOnly")]
        assert [m["name"] for m in writable] == ["parwatch-state"], where
        state_dir = writable[0]["mountPath"]
        assert f"--state-dir={state_dir}" in sc["args"]
        (state,) = [v for v in pod["spec"]["volumes"] if v["name"] == "parwatch-state"]
        assert set(state) & {"emptyDir", "persistentVolumeClaim"}
        # Named metrics port and /healthz probes on it.
        assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in sc["ports"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert sc[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
        assert "--metrics-listen=0.0.0.0:9400" in sc["args"]


def token_env(sidecar: dict) -> dict:
    (env,) = [e for e in sidecar["env"] if e["name"] == "PARWATCH_TOKEN"]
    return env["valueFrom"]["secretKeyRef"]


def test_control_stays_on_loopback_behind_a_generated_token(rendered):
    """Issue 11: writes are authenticated by default; the chart generates the token Secret."""
    docs = rendered["default"]
    (secret,) = of_kind(docs, "Secret")
    assert set(secret["data"]) == {"token"} and len(base64.b64decode(secret["data"]["token"])) == 48
    for _where, pod in pod_specs(docs):
        sc = container(pod, "parwatch-sidecar", init=True)
        assert "--control-listen=127.0.0.1:9401" in sc["args"]
        # By environment: the sidecar refuses group-readable token files, and fsGroup makes mounted ones so.
        assert not any(a.startswith("--token-file") for a in sc["args"])
        assert token_env(sc) == {"name": secret["metadata"]["name"], "key": "token"}
        assert [p["name"] for p in sc["ports"]] == ["metrics"]
        trainer = pod["spec"]["containers"][0]
        assert trainer["args"][-3:-1] == ["--parwatch=on", "--parwatch-endpoint=http://127.0.0.1:9401"]
        assert trainer["args"][-1].startswith("--parwatch-token-file=")
        assert {"name": "PARWATCH_ENDPOINT", "value": "http://127.0.0.1:9401"} in trainer["env"]


@pytest.mark.parametrize("config", CONFIGS)
def test_the_sidecar_sees_the_trainers_processes(rendered, config):
    """Its pid checks (a crashed rank is "gone" at once) and hang stack dumps (SIGUSR1 to the culprit)
    need one process namespace per pod: by default each container has its own, and every rank would
    read as gone."""
    for where, pod in pod_specs(rendered[config]):
        assert pod["spec"]["shareProcessNamespace"] is True, where


@pytest.mark.parametrize("config", CONFIGS)
def test_trainer_and_sidecar_report_the_node_as_their_host(rendered, config):
    """A container's hostname is its pod's name: without this two pods of one node read as two hosts,
    and host contention (parwatch.guardrails.attribution) never shows."""
    node_name = {"name": "PARWATCH_HOST", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    for where, pod in pod_specs(rendered[config]):
        assert node_name in container(pod, "parwatch-sidecar", init=True)["env"], where
        assert node_name in pod["spec"]["containers"][0]["env"], where


def test_own_trainer_gets_the_endpoint_by_environment_only(helm):
    docs = render(helm, sets=["training.parwatchArgs=false", "training.module=mytrain.main"])
    (job,) = of_kind(docs, "Job")
    trainer = container(job["spec"]["template"], "trainer")
    assert trainer["args"][-2:] == ["-m", "mytrain.main"]
    assert {"name": "PARWATCH_ENDPOINT", "value": "http://127.0.0.1:9401"} in trainer["env"]


@pytest.mark.parametrize("config", ["all-features", "trainjob"])
def test_exposed_control_uses_the_token_secret(rendered, config):
    docs = rendered[config]
    for _where, pod in pod_specs(docs):
        sc = container(pod, "parwatch-sidecar", init=True)
        assert "--control-listen=0.0.0.0:9401" in sc["args"]
        token_file = "/var/run/secrets/parwatch/token"
        trainer = pod["spec"]["containers"][0]
        assert f"--parwatch-token-file={token_file}" in trainer["args"]
        assert {"name": "PARWATCH_TOKEN_FILE", "value": token_file} in trainer["env"]
        (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "parwatch-token"]
        secret_name = vol["secret"]["secretName"]
        assert token_env(sc)["name"] == secret_name
        if config == "trainjob":
            (secret,) = of_kind(docs, "Secret")
            assert secret["metadata"]["name"] == secret_name and set(secret["data"]) == {"token"}
        else:
            assert secret_name == "parwatch-control-token"


def test_exposing_control_without_a_token_of_yours_uses_the_generated_one(helm):
    docs = render(helm, sets=["sidecar.exposeControl=true"])
    (secret,) = of_kind(docs, "Secret")
    for _where, pod in pod_specs(docs):
        assert token_env(container(pod, "parwatch-sidecar", init=True))["name"] == secret["metadata"]["name"]


def test_rules_configmap_defaults_to_the_packaged_rules_and_accepts_a_file(helm, rendered, tmp_path):
    (cm,) = [c for c in of_kind(rendered["default"], "ConfigMap") if c["metadata"]["name"].endswith("-rules")]
    packaged = (ROOT / "parwatch" / "sidecar" / "default_rules.yaml").read_text()
    assert yaml.safe_load(cm["data"]["rules.yaml"]) == yaml.safe_load(packaged)
    custom = tmp_path / "rules.yaml"
    custom.write_text(
        "version: 1\nrules:\n  - {name: stage-skew, metric: pipeline_skew_ratio, above: 1.5, action: alert}\n"
    )
    proc = run_helm(helm, "template", RELEASE, CHART, "--set-file", f"sidecar.rules.content={custom}")
    assert proc.returncode == 0, proc.stderr
    (cm,) = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "ConfigMap"]
    assert yaml.safe_load(cm["data"]["rules.yaml"]) == yaml.safe_load(custom.read_text())


# --- the schema catches typos -------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting,complaint",
    [
        ("sidecar.metricPort=9400", "metricPort"),  # misspelt sidecar.metricsPort
        ("monitoring.podMonitor.enable=true", "enable"),
        ("workload.kind=PyTorchJob", "kind"),
        ("training.nnodes=0", "nnodes"),
        ("monitoring.agentConfig.remoteWrite[0].url=victoria:8428", "url"),  # no scheme
        ("monitoring.agentConfig.scrapeInterval=often", "scrapeInterval"),
    ],
)
def test_schema_rejects_bad_values(helm, setting, complaint):
    for command in (["template", RELEASE], ["lint", "--strict"]):
        proc = run_helm(helm, *command, CHART, "--set", setting)
        assert proc.returncode != 0, f"helm {command[0]} accepted {setting}"
        assert complaint in proc.stdout + proc.stderr


# --- the Indexed Job ----------------------------------------------------------------------------


def test_indexed_job_runs_torchrun_with_rendezvous_on_pod_zero(rendered):
    docs = rendered["all-features"]
    (job,) = of_kind(docs, "Job")
    (svc,) = of_kind(docs, "Service")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    assert spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    trainer = container(spec["template"], "trainer")
    assert trainer["command"] == ["torchrun"]
    args = trainer["args"]
    assert "--nnodes=4" in args and "--nproc-per-node=8" in args
    assert "--node-rank=$(JOB_COMPLETION_INDEX)" in args
    master = f"{job['metadata']['name']}-0.{svc['metadata']['name']}.{NAMESPACE}.svc"
    assert f"--master-addr={master}" in args and "--master-port=29500" in args
    user_args = yaml.safe_load(CONFIGS["all-features"][0].read_text())["training"]["args"]
    m = args.index("-m")
    assert args[m + 1 : m + 3 + len(user_args)] == ["parwatch", "train", *user_args]
    env = {e["name"]: e for e in trainer["env"]}
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"} in trainer["ports"]
    assert {p["targetPort"] for p in svc["spec"]["ports"]} >= {"rendezvous", "metrics", "control"}


# --- custom resources, checked structurally -----------------------------------------------------


def test_podmonitor_scrapes_the_sidecars_metrics_port(rendered):
    docs = rendered["all-features"]
    (pm,) = of_kind(docs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "15s" and endpoint["scrapeTimeout"] == "10s"
    # The port it names exists on the pods it selects.
    for _, pod in pod_specs(docs):
        assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert "metrics" in [p["name"] for p in container(pod, "parwatch-sidecar", init=True)["ports"]]


def test_prometheusrule_carries_exactly_the_rendered_alert_groups(rendered, tmp_path):
    (rule,) = of_kind(rendered["all-features"], "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    # The alerts read recorded series: the recording group comes with them.
    expected = (
        yaml.safe_load((CHART / "files" / "recording_rules.yaml").read_text())["groups"]
        + yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())["groups"]
    )
    assert rule["spec"]["groups"] == expected
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for r in group["rules"]:
            assert (r.get("alert") or r.get("record")) and r["expr"]
    promtool = shutil.which("promtool")
    if promtool:  # the operator hands spec.groups to Prometheus as a rules file
        path = tmp_path / "rules.yaml"
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_prometheusrule_can_leave_recording_to_another_evaluator(helm):
    docs = render(
        helm, sets=["monitoring.prometheusRule.enabled=true", "monitoring.prometheusRule.recordingRules=false"]
    )
    (rule,) = of_kind(docs, "PrometheusRule")
    assert [g["name"] for g in rule["spec"]["groups"]] == ["parwatch-guardrails"]


def _configmap(docs, suffix):
    (cm,) = [c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith(suffix)]
    return cm


def test_rule_files_configmap_passes_promtool_and_vmalert(rendered, tmp_path):
    """The plain rule files an evaluator such as vmalert mounts: both files, valid for both tools."""
    cm = _configmap(rendered["all-features"], "-rule-files")
    assert set(cm["data"]) == {"recording_rules.yaml", "alerts.yaml"}
    for key, text in cm["data"].items():
        assert yaml.safe_load(text) == yaml.safe_load((CHART / "files" / key).read_text()), key
        (tmp_path / key).write_text(text)
    paths = [str(tmp_path / key) for key in sorted(cm["data"])]
    promtool, vmalert = shutil.which("promtool"), shutil.which("vmalert")
    if promtool:
        proc = subprocess.run([promtool, "check", "rules", *paths], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    if vmalert:  # MetricsQL is PromQL's superset, but vmalert parses every expression itself
        proc = subprocess.run(
            [vmalert, "-dryRun", *(f"-rule={p}" for p in paths)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_agent_config_scrapes_this_release_and_remote_writes(rendered, tmp_path):
    """prometheus.yml for the user's agent-mode Prometheus. Debian's promtool is built without
    Kubernetes discovery, so the discovery block is checked here and promtool checks the rest
    with a static target in its place."""
    docs = rendered["all-features"]
    config = yaml.safe_load(_configmap(docs, "-prometheus-agent")["data"]["prometheus.yml"])
    values = yaml.safe_load(CONFIGS["all-features"][0].read_text())["monitoring"]["agentConfig"]
    assert config["remote_write"] == values["remoteWrite"]
    assert config["global"]["scrape_interval"] == "10s" and config["global"]["external_labels"] == {
        "cluster": "train-a"
    }
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": [NAMESPACE]}}]
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    selector = ";".join(SELECTOR[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance"))
    assert keep[0]["regex"] == selector and keep[0]["source_labels"] == [
        "__meta_kubernetes_pod_label_app_kubernetes_io_name",
        "__meta_kubernetes_pod_label_app_kubernetes_io_instance",
    ]
    assert keep[1] == {
        "source_labels": ["__meta_kubernetes_pod_container_port_name"],
        "regex": "metrics",
        "action": "keep",
    }
    # The port it keeps is the sidecar's, on the pods the selector picks.
    for _, pod in pod_specs(docs):
        assert "metrics" in [p["name"] for p in container(pod, "parwatch-sidecar", init=True)["ports"]]
    promtool = shutil.which("promtool")
    if promtool:
        job = dict(job, static_configs=[{"targets": ["127.0.0.1:9400"]}])
        del job["kubernetes_sd_configs"]
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(dict(config, scrape_configs=[job])))
        proc = subprocess.run(
            [promtool, "check", "config", "--agent", str(path)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_agent_config_without_remote_write_is_refused(helm):
    proc = run_helm(helm, "template", RELEASE, CHART, "--set", "monitoring.agentConfig.enabled=true")
    assert proc.returncode != 0 and "monitoring.agentConfig.remoteWrite" in proc.stderr


def test_trainjob_references_its_runtime(rendered):
    docs = rendered["trainjob"]
    (tj,) = of_kind(docs, "TrainJob")
    (rt,) = of_kind(docs, "TrainingRuntime")
    for obj in (tj, rt):
        assert obj["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert tj["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": rt["metadata"]["name"],
    }
    assert tj["spec"]["trainer"]["numNodes"] == rt["spec"]["mlPolicy"]["numNodes"] == 2
    assert tj["spec"]["trainer"]["numProcPerNode"] == 4 and tj["spec"]["suspend"] is True
    assert tj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "user-queue"
    assert rt["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    assert "torch" in rt["spec"]["mlPolicy"]
    (rj,) = rt["spec"]["template"]["spec"]["replicatedJobs"]
    assert rj["name"] == "node"
    assert rj["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    node = container(rj["template"]["spec"]["template"], "node")  # the Torch plugin targets this name
    assert node["command"] == ["torchrun"] and node["args"][:3] == ["-m", "parwatch", "train"]


def test_grafana_dashboard_configmap(rendered):
    (cm,) = [c for c in of_kind(rendered["all-features"], "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "parwatch"}
    assert json.loads(cm["data"]["parwatch.json"]) == json.loads((ROOT / "dashboards" / "parwatch.json").read_text())


def test_image_overrides_apply_per_container(helm):
    docs = render(helm, sets=["image.tag=1.2.3", "sidecar.image.repository=registry.local/parwatch-sidecar"])
    (job,) = of_kind(docs, "Job")
    pod = job["spec"]["template"]
    assert container(pod, "parwatch-sidecar", init=True)["image"] == "registry.local/parwatch-sidecar:1.2.3"
    assert container(pod, "trainer")["image"] == "ghcr.io/parwatch/parwatch:1.2.3"
