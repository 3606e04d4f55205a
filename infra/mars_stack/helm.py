"""The Helm chart (`charts/mars`) rendered by real Helm: Helm v4 as a library (helm-python-sdk), no binary.

`install_dry_run` is `helm install --dry-run=client`: it enforces the values schema, the chart's
kubeVersion and YAML well-formedness, and returns the release's objects (hooks excluded). `render` renders
every template (hooks included) for a chosen Kubernetes version and set of installed APIs, the way
`helm template --kube-version --api-versions` does, after the same checks. `service_env` reads off a
rendered Deployment the environment its container would get, so a test can run the image with exactly
what the chart gives it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "charts" / "mars"

#: The Kubernetes versions the chart is validated against (Chart.yaml kubeVersion: >=1.29).
OLDEST_KUBE = "1.29.0"
NEWEST_KUBE = "1.37.0"

#: Optional APIs the chart renders for when the cluster has them.
STRIMZI_API = "kafka.strimzi.io/v1beta2/KafkaTopic"
STRIMZI_USER_API = "kafka.strimzi.io/v1beta2/KafkaUser"


class ChartError(Exception):
    """Helm refused the chart or the values (schema, kubeVersion, a template's `required` or `fail`)."""


#: libyaml's safe loader where PyYAML was built with it: the same documents as yaml.SafeLoader, parsed in C
#: (a chart render is megabytes of YAML; the pure-Python scanner took most of a chart test's time).
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _objects(manifests: Iterable[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for text in manifests:
        out += [doc for doc in yaml.load_all(text, Loader=_SAFE_LOADER) if doc]  # a safe loader, C or Python
    return out


def install_dry_run(
    values: dict[str, Any], release: str = "mars", namespace: str = "mars", chart: Path = CHART_DIR
) -> list[dict[str, Any]]:
    """`helm install --dry-run=client`: the release's objects (no hooks), or ChartError with Helm's words."""
    import helm_python

    config = helm_python.Config(storage_driver="memory", namespace=namespace)
    try:
        release_info = config.install(str(chart), release, values, dry_run="client", namespace=namespace)
    except helm_python.HelmError as exc:
        raise ChartError(str(exc)) from exc
    finally:
        config.close()
    return _objects([release_info["manifest"]])


def render(
    values: dict[str, Any],
    release: str = "mars",
    namespace: str = "mars",
    kube_version: str = NEWEST_KUBE,
    api_versions: Iterable[str] = (),
    chart: Path = CHART_DIR,
) -> list[dict[str, Any]]:
    """Every object the chart renders (hook Jobs included) for a Kubernetes version and installed APIs.

    The values pass `install_dry_run`'s checks first; then the templates render with the given
    capabilities (helm-python-sdk's `Chart.render` does not expose them, so this calls its C entry point).
    """
    manifests = _render(values, release, namespace, kube_version, api_versions, chart)
    return _objects(text for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt"))


def notes(values: dict[str, Any], release: str = "mars", namespace: str = "mars") -> str:
    """The NOTES.txt `helm install` prints for these values."""
    manifests = _render(values, release, namespace, NEWEST_KUBE, (), CHART_DIR)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def _render(
    values: dict[str, Any],
    release: str,
    namespace: str,
    kube_version: str,
    api_versions: Iterable[str],
    chart: Path,
) -> dict[str, str]:
    import helm_python
    from helm_python import _native

    install_dry_run(values, release, namespace, chart)
    loaded = helm_python.Chart.load(str(chart))
    options = {
        "name": release,
        "namespace": namespace,
        "is_install": True,
        "kube_version": f"v{kube_version}",
        "api_versions": list(api_versions),
    }
    try:
        rendered = _native.call_string("helm_render", loaded._raw(), json.dumps(values), json.dumps(options))
    except helm_python.HelmError as exc:
        raise ChartError(str(exc)) from exc
    finally:
        loaded.close()
    manifests: dict[str, str] = json.loads(rendered)
    return manifests


def lint(values: dict[str, Any], kube_version: str = NEWEST_KUBE, chart: Path = CHART_DIR) -> list[str]:
    """`helm lint --strict`: the findings at warning level or above (info-level advice is left out)."""
    import helm_python

    report = helm_python.lint(str(chart), values, strict=True, kube_version=f"v{kube_version}")
    return [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2] + list(
        report.get("errors") or []
    )


def find(objects: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    """The rendered objects of a kind (and name)."""
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def service_env(objects: list[dict[str, Any]], component: str, pod_name: str = "") -> dict[str, str]:
    """The environment the container of Deployment `<fullname>-<component>` gets: its envFrom ConfigMaps
    (from the rendered objects), then its env list. Secret-backed values are not in the rendered objects
    (they come from the cluster) and are left out; a fieldRef to the pod's name takes `pod_name`."""
    deployments = [
        o
        for o in find(objects, "Deployment")
        if o["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    if len(deployments) != 1:
        raise KeyError(f"expected one Deployment for {component!r}, found {len(deployments)}")
    container = deployments[0]["spec"]["template"]["spec"]["containers"][0]
    config_maps = {o["metadata"]["name"]: o.get("data") or {} for o in find(objects, "ConfigMap")}
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        if "configMapRef" in source:
            env.update(config_maps[source["configMapRef"]["name"]])
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = pod_name
    return env


def job_args(objects: list[dict[str, Any]], component: str) -> list[str]:
    """The container arguments of the rendered Job labelled app.kubernetes.io/component=`component`."""
    (job,) = [
        j
        for j in find(objects, "Job")
        if j["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    return list(job["spec"]["template"]["spec"]["containers"][0]["args"])
