"""deploy/node-agent and deploy/components: the agent DaemonSets, the plugin waiting for them, and the two
placement components (the cluster default when the workload label is absent; the GPU Operator's labels).

Built with ``kubectl kustomize`` like tests/test_deploy.py (which also validates every built object with
``kubernetes-validate --strict``); here: what the build holds.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_deploy import DEPLOY, Doc, assert_validates, container, kustomize_build, load_all, one

WORKLOAD = "nvidia.com/gpu.workload.config"
STATE_DIR = "/run/kubevirt-gpu-passthrough/node-agent"
AGENTS = {"gpu-node-agent-passthrough": "vm-passthrough", "gpu-node-agent-vgpu": "vm-vgpu"}


def terms(daemonset: Doc) -> list[dict[str, Any]]:
    affinity = daemonset["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    found = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert isinstance(found, list)
    return found


def schedules_on(daemonset: Doc, labels: dict[str, str]) -> bool:
    """Whether a node with ``labels`` matches the DaemonSet's required node affinity (terms ORed, expressions
    ANDed), for the operators used here."""

    def holds(expression: dict[str, Any]) -> bool:
        value = labels.get(expression["key"])
        operator = expression["operator"]
        if operator == "In":
            return value in expression["values"]
        if operator == "DoesNotExist":
            return value is None
        raise AssertionError(f"operator {operator} not expected here")

    return any(all(holds(expression) for expression in term["matchExpressions"]) for term in terms(daemonset))


def build_with(tmp_path: Path, *components: str) -> list[Doc]:
    """deploy/ built with extra components (as a user's overlay would add them)."""
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(DEPLOY, tmp_path)],
                "components": [os.path.relpath(DEPLOY / "components" / name, tmp_path) for name in components],
            }
        )
    )
    return kustomize_build(tmp_path)


def test_each_workload_label_gets_its_agent_and_both_vm_workloads_the_plugin() -> None:
    built = kustomize_build(DEPLOY)
    plugin = one(built, "DaemonSet", "gpu-device-plugin")
    agents = {name: one(built, "DaemonSet", name) for name in AGENTS}
    for value in ("vm-passthrough", "vm-vgpu", "container", None):
        labels = {WORKLOAD: value} if value else {"nvidia.com/gpu.present": "true"}
        assert schedules_on(plugin, labels) == (value in AGENTS.values()), value
        for name, workload in AGENTS.items():
            assert schedules_on(agents[name], labels) == (value == workload), (name, value)


def test_agents_run_their_commands_and_stay_so_that_stopping_changes_nothing() -> None:
    built = kustomize_build(DEPLOY)
    passthrough = container(one(built, "DaemonSet", "gpu-node-agent-passthrough"))
    vgpu = container(one(built, "DaemonSet", "gpu-node-agent-vgpu"))
    assert (passthrough["command"], passthrough["args"]) == (["gpu-node-agent"], ["bind", "--all", "--stay"])
    assert (vgpu["command"], vgpu["args"]) == (["gpu-node-agent"], ["vgpu", "apply", "--stay"])
    for main, workload in ((passthrough, "vm-passthrough"), (vgpu, "vm-vgpu")):
        env = {item["name"]: item for item in main["env"]}
        assert env["GPU_NODE_AGENT_HOST_ROOT"]["value"] == "/host"
        assert env["GPU_NODE_AGENT_STATE_DIR"]["value"] == STATE_DIR
        probe = main["readinessProbe"]["exec"]["command"]
        assert probe[:2] == ["gpu-node-agent", "validate"] and probe[probe.index("--workload") + 1] == workload


def test_the_vgpu_agent_applies_the_configmaps_selected_config() -> None:
    built = kustomize_build(DEPLOY)
    daemonset = one(built, "DaemonSet", "gpu-node-agent-vgpu")
    env = {item["name"]: item for item in container(daemonset)["env"]}
    reference = env["GPU_NODE_AGENT_VGPU_SELECT"]["valueFrom"]["configMapKeyRef"]
    (volume,) = [v for v in daemonset["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    # The generated name (content hash) is the same in both references, so a change rolls the DaemonSet.
    assert reference["name"] == volume["configMap"]["name"] and reference["name"].startswith("gpu-node-agent-vgpu-")
    configmap = one(built, "ConfigMap", reference["name"])
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert config["version"] == "v1"
    assert configmap["data"][reference["key"]] in config["vgpu-configs"]
    mount = next(m for m in container(daemonset)["volumeMounts"] if m["name"] == volume["name"])
    assert f"{mount['mountPath']}/config.yaml" == env["GPU_NODE_AGENT_VGPU_CONFIG"]["value"]
    assert mount["readOnly"] is True


def test_agents_are_privileged_with_only_the_host_paths_they_need_and_no_api_access() -> None:
    built = kustomize_build(DEPLOY)
    account = one(built, "ServiceAccount", "gpu-node-agent")
    assert account["automountServiceAccountToken"] is False
    assert not [doc for doc in built if doc["kind"] in {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}]
    expected = {
        "gpu-node-agent-passthrough": {
            "/host/sys": ("/sys", False),
            "/host/dev/vfio": ("/dev/vfio", True),
            "/host/proc": ("/proc", True),
            "/host/lib/modules": ("/lib/modules", True),
            STATE_DIR: (STATE_DIR, False),
        },
        "gpu-node-agent-vgpu": {
            "/host/sys": ("/sys", False),
            "/host/dev/vfio": ("/dev/vfio", True),
            "/host/proc": ("/proc", True),
            STATE_DIR: (STATE_DIR, False),
        },
    }
    for name, paths in expected.items():
        daemonset = one(built, "DaemonSet", name)
        pod = daemonset["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "gpu-node-agent" and pod["automountServiceAccountToken"] is False
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        main = container(daemonset)
        assert main["securityContext"]["privileged"] is True
        assert main["securityContext"]["readOnlyRootFilesystem"] is True
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        host = {
            mount["mountPath"]: (volumes[mount["name"]]["hostPath"]["path"], mount.get("readOnly", False))
            for mount in main["volumeMounts"]
            if "hostPath" in volumes[mount["name"]]
        }
        assert host == paths, name
        # /dev/vfio exists only once a VFIO module is loaded, which on a fresh node is the agent's own work: a
        # hostPath of type Directory would keep the agent from starting there, forever.
        (vfio,) = [v for v in pod["volumes"] if v.get("hostPath", {}).get("path") == "/dev/vfio"]
        assert vfio["hostPath"]["type"] == "DirectoryOrCreate", name


def test_the_plugin_waits_for_the_agents_readiness_file_read_only_and_unprivileged() -> None:
    built = kustomize_build(DEPLOY)
    pod = one(built, "DaemonSet", "gpu-device-plugin")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert f"{STATE_DIR}/ready" in init["args"][0] and init["command"] == ["sh", "-c"]
    context = init["securityContext"]
    assert context["privileged"] is False and context["runAsNonRoot"] is True
    assert context["capabilities"] == {"drop": ["ALL"]}
    (mount,) = init["volumeMounts"]
    volume = next(volume for volume in pod["volumes"] if volume["name"] == mount["name"])
    assert (mount["mountPath"], mount["readOnly"], volume["hostPath"]["path"]) == (STATE_DIR, True, STATE_DIR)
    # One image everywhere (the init container's is in the component's patch: it must not drift).
    images = {
        c["image"]
        for doc in built
        if doc["kind"] == "DaemonSet"
        for c in [
            *doc["spec"]["template"]["spec"]["containers"],
            *doc["spec"]["template"]["spec"].get("initContainers", []),
        ]
    }
    assert len(images) == 1


def test_the_default_workload_component_takes_unlabelled_gpu_nodes_as_vm_passthrough(tmp_path: Path) -> None:
    built = build_with(tmp_path, "default-workload-vm-passthrough")
    unlabelled_gpu, unlabelled_other = {"nvidia.com/gpu.present": "true"}, {"kubernetes.io/os": "linux"}
    for name in ("gpu-device-plugin", "gpu-node-agent-passthrough"):
        daemonset = one(built, "DaemonSet", name)
        assert schedules_on(daemonset, unlabelled_gpu) and not schedules_on(daemonset, unlabelled_other)
        assert schedules_on(daemonset, {WORKLOAD: "vm-passthrough"})
        assert not schedules_on(daemonset, {WORKLOAD: "container", "nvidia.com/gpu.present": "true"})
    assert not schedules_on(one(built, "DaemonSet", "gpu-node-agent-vgpu"), unlabelled_gpu)


def test_the_gpu_operator_component_follows_its_deploy_labels(tmp_path: Path) -> None:
    built = build_with(tmp_path, "gpu-operator")
    deploy_labels = {
        "gpu-device-plugin": "nvidia.com/gpu.deploy.sandbox-device-plugin",
        "gpu-node-agent-passthrough": "nvidia.com/gpu.deploy.vfio-manager",
        "gpu-node-agent-vgpu": "nvidia.com/gpu.deploy.vgpu-device-manager",
    }
    for name, label in deploy_labels.items():
        daemonset = one(built, "DaemonSet", name)
        assert schedules_on(daemonset, {label: "true"})
        assert not schedules_on(daemonset, {label: "false", WORKLOAD: "vm-passthrough"})
        assert not schedules_on(daemonset, {WORKLOAD: "vm-vgpu"})


def test_components_are_kustomize_components() -> None:
    for directory in sorted((DEPLOY / "components").iterdir()):
        (kustomization,) = load_all((directory / "kustomization.yaml").read_text())
        assert kustomization["kind"] == "Component", directory


def agent_invocations(docs: list[Doc]) -> list[tuple[str, list[str], dict[str, str]]]:
    """Every ``gpu-node-agent`` command the built manifests run (containers and exec probes), with its
    container's env (an exec probe runs with it)."""
    found = []
    for daemonset in (doc for doc in docs if doc["kind"] == "DaemonSet"):
        pod = daemonset["spec"]["template"]["spec"]
        for each in pod.get("initContainers", []) + pod["containers"]:
            env = {item["name"]: item.get("value", "<from a ConfigMap>") for item in each.get("env", [])}
            argv = [*each.get("command", []), *each.get("args", [])]
            commands = [argv] + [
                each[probe]["exec"]["command"]
                for probe in ("readinessProbe", "livenessProbe", "startupProbe")
                if "exec" in each.get(probe, {})
            ]
            for command in commands:
                if command and command[0] == "gpu-node-agent":
                    found.append((f"{daemonset['metadata']['name']}/{each['name']}", command[1:], env))
    return found


def test_every_agent_command_and_env_the_manifests_use_is_one_the_agent_takes(tmp_path: Path) -> None:
    """The manifests and the CLI are written apart: each argv must parse with the real click command, and every
    ``GPU_NODE_AGENT_*`` variable must be the env var of an option of the command it is given to."""
    import click

    from node_agent.cli import cli

    docs = build_with(tmp_path, "gpu-operator")
    invocations = agent_invocations(docs)
    assert {name.split("/")[0] for name, _, _ in invocations} == set(AGENTS)
    for name, args, env in invocations:
        command: click.Command = cli
        words = list(args)
        while isinstance(command, click.Group):  # the subcommands, by name, as click dispatches them
            found = command.get_command(click.Context(command), words[0]) if words else None
            assert found is not None, f"{name}: no command in `gpu-node-agent {' '.join(args)}`"
            command, words = found, words[1:]
        command.make_context(command.name, words)  # an unknown option or a bad value raises here
        accepted = {param.envvar for param in command.params if isinstance(param.envvar, str)}
        accepted |= {param.envvar for param in cli.params if isinstance(param.envvar, str)}
        unknown = {key for key in env if key.startswith("GPU_NODE_AGENT_")} - accepted
        assert not unknown, f"{name}: `gpu-node-agent {' '.join(args)}` has no option for {sorted(unknown)}"


def _run_wait(script: str, state_dir: Path, wait_seconds: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", "-c", script.replace(STATE_DIR, str(state_dir))],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "WAIT_SECONDS": wait_seconds},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_the_plugins_wait_for_the_agent_is_bounded_and_says_what_to_look_at(tmp_path: Path) -> None:
    built = kustomize_build(DEPLOY)
    (init,) = one(built, "DaemonSet", "gpu-device-plugin")["spec"]["template"]["spec"]["initContainers"]
    env = {item["name"]: item["value"] for item in init["env"]}
    assert 60 <= int(env["WAIT_SECONDS"]) <= 3600
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"  # kubectl describe shows why
    (script,) = init["args"]
    given_up = _run_wait(script, tmp_path, "0")
    assert given_up.returncode == 1
    assert f"the node agent did not mark this node ready ({tmp_path}/ready) within 0s" in given_up.stdout
    assert "gpu-node-agent-passthrough (vm-passthrough) or gpu-node-agent-vgpu (vm-vgpu)" in given_up.stdout
    (tmp_path / "ready").write_text("")
    done = _run_wait(script, tmp_path, "0")
    assert (done.returncode, done.stdout) == (0, "")


@pytest.mark.parametrize("component", ["default-workload-vm-passthrough", "gpu-operator"])
def test_deploy_with_each_optional_component_validates_strictly(tmp_path: Path, component: str) -> None:
    (tmp_path / "overlay").mkdir()
    built = build_with(tmp_path / "overlay", component)
    output = tmp_path / "built.yaml"
    output.write_text(yaml.safe_dump_all(built))
    assert_validates([output], built)
