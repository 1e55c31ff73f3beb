"""The names of the GPU Operator's node-label protocol as ``gpu-node-agent operate`` speaks it, and its defaults.

Kept apart from :mod:`node_agent.operate` (which loads the Kubernetes client) so the other commands, the
readiness probe's ``validate`` among them, start without it. docs/node-agent.md, "The GPU Operator's node-label
protocol", says what each is for.
"""

from __future__ import annotations

WORKLOADS = ("container", "vm-passthrough", "vm-vgpu")
WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"
"""The GPU Operator's per-node workload (``sandboxWorkloads.defaultWorkload`` when absent)."""
VGPU_CONFIG_LABEL = "nvidia.com/vgpu.config"
"""vgpu-device-manager's per-node vGPU config name."""
VGPU_STATE_LABEL = "nvidia.com/vgpu.config.state"
"""vgpu-device-manager's report: ``pending``, ``success``, ``failed`` (written on vm-vgpu nodes only)."""
WORKLOAD_STATE_LABEL = "nvidia.com/gpu.workload.config.state"
"""Ours, beside NVIDIA's: ``pending``, ``success``, ``failed`` or ``refused`` for the whole transition."""
PLUGIN_DEPLOY_LABEL = "nvidia.com/gpu.deploy.sandbox-device-plugin"
"""The GPU Operator's deploy label of the sandbox device plugin (our plugin's DaemonSet follows it)."""
PAUSED = "paused-for-vgpu-change"
"""The value vgpu-device-manager gives :data:`PLUGIN_DEPLOY_LABEL` while it reconfigures."""
ANNOTATION_PREFIX = "gpu-passthrough.kubevirt.io/"
PAUSED_FROM_ANNOTATION = ANNOTATION_PREFIX + "paused-sandbox-device-plugin"
"""While paused: ``{"previous": <the deploy label's value, or null when it was absent>}``."""
MESSAGE_ANNOTATION = ANNOTATION_PREFIX + "workload.config.message"
"""The last transition's human message (what was done, or why not: the GPUs and the pods)."""
STATE_LABELS = (WORKLOAD_STATE_LABEL, VGPU_STATE_LABEL, PLUGIN_DEPLOY_LABEL)
"""Every label this agent writes besides the feature labels of the core's prefixes."""
ANNOTATIONS = (PAUSED_FROM_ANNOTATION, MESSAGE_ANNOTATION)
MAX_MESSAGE_CHARS = 4096
MAX_PAUSE_RECORD_CHARS = 512
CONFLICT_RETRIES = 5
DEFAULT_PAUSE_TIMEOUT = 120.0
DEFAULT_RETRY_PERIOD = 30.0
DEFAULT_RESOURCE_PREFIX = "nvidia.com/"
