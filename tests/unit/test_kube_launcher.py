"""The local Kubernetes launcher's pure parts (infra/mars_stack/kube.py, kube_nodes.py,
kube_control_plane.py): the nodes kwok plays and the stages it runs. tests/k8s starts the real control plane."""

from __future__ import annotations

from pathlib import Path

import yaml
from mars_stack import kube
from mars_tools.cli import build_parser


def test_gpu_node_offers_gpus_behind_the_nvidia_taint() -> None:
    node = kube.GPU_NODE.manifest()
    assert node["status"]["capacity"][kube.GPU_RESOURCE] == "1"
    assert node["status"]["allocatable"] == node["status"]["capacity"]
    assert node["spec"]["taints"] == [kube.GPU_TAINT]
    assert node["metadata"]["annotations"] == {kube.KWOK_ANNOTATION[0]: kube.KWOK_ANNOTATION[1]}
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "gpu-0"
    cpu = kube.CPU_NODES[0].manifest()
    assert kube.GPU_RESOURCE not in cpu["status"]["capacity"] and cpu["spec"]["taints"] == []


def test_stages_ready_pods_complete_jobs_and_held_components_are_left_alone(tmp_path: Path) -> None:
    stages = {s["metadata"]["name"]: s for s in yaml.safe_load_all(kube.STAGES.read_text())}
    assert set(stages) == {"node-initialize", "pod-ready", "pod-complete", "pod-delete"}
    assert all(s["kind"] == "Stage" for s in stages.values())
    cluster = kube.LocalCluster(workdir=tmp_path)
    assert cluster.control_plane.kwok_stages() == kube.STAGES
    held = kube.LocalCluster(workdir=tmp_path, held_components=("master-key",))
    changed = {
        s["metadata"]["name"]: s for s in yaml.safe_load_all(held.control_plane.kwok_stages().read_text())
    }
    complete = changed["pod-complete"]["spec"]["selector"]["matchExpressions"]
    assert complete[-1] == {
        "key": '.metadata.labels["app.kubernetes.io/component"]',
        "operator": "NotIn",
        "values": ["master-key"],
    }
    assert changed["pod-ready"] == stages["pod-ready"]


def test_kube_cli_parses() -> None:
    args = build_parser().parse_args(["kube", "up", "--gpu-nodes", "0", "--cpu-nodes", "3"])
    assert (args.gpu_nodes, args.cpu_nodes, args.volumes) == (0, 3, 4)
