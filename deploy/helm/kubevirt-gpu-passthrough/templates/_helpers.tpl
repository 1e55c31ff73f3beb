{{/*
Helpers. Every object name is fixed (kustomize's names, so that the chart renders exactly what deploy/ builds):
one release per cluster.
*/}}

{{/* "true" when the node component is rendered. */}}
{{- define "kgp.plugin" -}}
{{- and .Values.sandboxWorkloads.enabled .Values.sandboxDevicePlugin.enabled -}}
{{- end -}}
{{- define "kgp.passthrough" -}}
{{- and .Values.sandboxWorkloads.enabled .Values.vfioManager.enabled -}}
{{- end -}}
{{- define "kgp.vgpu" -}}
{{- and .Values.sandboxWorkloads.enabled .Values.vgpuDeviceManager.enabled -}}
{{- end -}}
{{- define "kgp.operate" -}}
{{- and .Values.sandboxWorkloads.enabled .Values.nodeLabelProtocol.enabled -}}
{{- end -}}
{{- define "kgp.dra" -}}
{{- and .Values.sandboxWorkloads.enabled .Values.dra.enabled -}}
{{- end -}}
{{- define "kgp.wait" -}}
{{- and (eq (include "kgp.plugin" .) "true") .Values.sandboxDevicePlugin.waitForNodeAgent.enabled -}}
{{- end -}}
{{- define "kgp.pluginApi" -}}
{{- eq .Values.launcherHook.api "plugins" -}}
{{- end -}}

{{/* Combinations that have no meaning: refused with a message naming the values. */}}
{{- define "kgp.check" -}}
{{- if eq .Values.sandboxWorkloads.defaultWorkload "vm-vgpu" -}}
{{- fail "sandboxWorkloads.defaultWorkload=vm-vgpu is not offered (deploy/components has default-workload-vm-passthrough only): label vGPU nodes nvidia.com/gpu.workload.config=vm-vgpu" -}}
{{- end -}}
{{- if and .Values.gpuOperator.deployLabels (ne .Values.sandboxWorkloads.defaultWorkload "container") -}}
{{- fail "gpuOperator.deployLabels=true with sandboxWorkloads.defaultWorkload set: the GPU Operator applies its own default (set it in its ClusterPolicy) and labels the nodes; leave defaultWorkload=container here" -}}
{{- end -}}
{{- if and (eq (include "kgp.wait" .) "true") (ne (include "kgp.passthrough" .) "true") (ne (include "kgp.vgpu" .) "true") -}}
{{- fail "sandboxDevicePlugin.waitForNodeAgent.enabled without vfioManager or vgpuDeviceManager: the plugin would wait for a node agent that is not deployed; set sandboxDevicePlugin.waitForNodeAgent.enabled=false" -}}
{{- end -}}
{{- end -}}

{{/*
The image of a component, the GPU Operator's way: repository/image:version, or repository/image@version for a
sha256: digest. Empty fields of the component fall back to sandboxDevicePlugin's.
Call with (list $component .Values.sandboxDevicePlugin).
*/}}
{{- define "kgp.image" -}}
{{- $own := index . 0 -}}
{{- $base := index . 1 -}}
{{- $repository := $own.repository | default $base.repository -}}
{{- $image := $own.image | default $base.image -}}
{{- $version := toString ($own.version | default $base.version) -}}
{{- if hasPrefix "sha256:" $version -}}
{{- printf "%s/%s@%s" $repository $image $version -}}
{{- else -}}
{{- printf "%s/%s:%s" $repository $image $version -}}
{{- end -}}
{{- end -}}

{{/* The app.kubernetes.io/part-of label every part of deploy/ adds (not the KubeVirt CR's). */}}
{{- define "kgp.partOf" -}}
app.kubernetes.io/part-of: kubevirt-gpu-passthrough
{{- end -}}

{{/* imagePullSecrets of a pod, from a list of names (the GPU Operator's shape). */}}
{{- define "kgp.pullSecrets" -}}
{{- if . }}
imagePullSecrets:
{{- range . }}
  - name: {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A container's env: the defaults (a list), each replaced by the user's entry of the same name; the user's others after. */}}
{{- define "kgp.env" -}}
{{- $defaults := index . 0 -}}
{{- $user := index . 1 -}}
{{- $names := dict -}}
{{- range $user }}{{- $_ := set $names .name true -}}{{- end -}}
{{- $out := list -}}
{{- range $defaults }}{{- if not (hasKey $names .name) }}{{- $out = append $out . -}}{{- end }}{{- end -}}
{{- $out = concat $out $user -}}
{{- if $out }}
env:
{{- toYaml $out | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The DaemonSets' common scheduling and update fields (the GPU Operator's daemonsets section). */}}
{{- define "kgp.updateStrategy" -}}
updateStrategy:
  type: {{ .Values.daemonsets.updateStrategy }}
  {{- if eq .Values.daemonsets.updateStrategy "RollingUpdate" }}
  rollingUpdate:
    maxUnavailable: {{ .Values.daemonsets.rollingUpdate.maxUnavailable }}
  {{- end }}
{{- end -}}
{{- define "kgp.scheduling" -}}
{{- with .Values.daemonsets.priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- with .Values.daemonsets.tolerations }}
tolerations:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The node selector terms of a DaemonSet (terms are ORed). Call with (list . "plugin"|"passthrough"|"vgpu").
- the workload label (deploy/ as built): the plugin on vm-passthrough and vm-vgpu nodes, each agent on its own;
- sandboxWorkloads.defaultWorkload=vm-passthrough: unlabelled GPU nodes too, for the plugin and the passthrough
  agent (deploy/components/default-workload-vm-passthrough);
- gpuOperator.deployLabels: the Operator's label of the component each replaces (deploy/components/gpu-operator);
- dra.enabled: the plugin kept off nodes labelled gpu-passthrough.kubevirt.io/dra=true (deploy/dra), in every term.
*/}}
{{- define "kgp.nodeSelectorTerms" -}}
{{- $root := index . 0 -}}
{{- $who := index . 1 -}}
{{- $values := $root.Values -}}
{{- $terms := list -}}
{{- if $values.gpuOperator.deployLabels -}}
{{- $label := get (dict "plugin" "sandbox-device-plugin" "passthrough" "vfio-manager" "vgpu" "vgpu-device-manager") $who -}}
{{- $terms = list (dict "matchExpressions" (list (dict "key" (printf "nvidia.com/gpu.deploy.%s" $label) "operator" "In" "values" (list "true")))) -}}
{{- else -}}
{{- $workloads := get (dict "plugin" (list "vm-passthrough" "vm-vgpu") "passthrough" (list "vm-passthrough") "vgpu" (list "vm-vgpu")) $who -}}
{{- $terms = list (dict "matchExpressions" (list (dict "key" "nvidia.com/gpu.workload.config" "operator" "In" "values" $workloads))) -}}
{{- if and (eq $values.sandboxWorkloads.defaultWorkload "vm-passthrough") (has $who (list "plugin" "passthrough")) -}}
{{- $terms = append $terms (dict "matchExpressions" (list (dict "key" "nvidia.com/gpu.workload.config" "operator" "DoesNotExist") (dict "key" "nvidia.com/gpu.present" "operator" "In" "values" (list "true")))) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $who "plugin") (eq (include "kgp.operate" $root) "true") -}}
{{- $first := index $terms 0 -}}
{{- $paused := dict "key" "nvidia.com/gpu.deploy.sandbox-device-plugin" "operator" "NotIn" "values" (list "paused-for-vgpu-change") -}}
{{- $terms = prepend (rest $terms) (dict "matchExpressions" (append $first.matchExpressions $paused)) -}}
{{- end -}}
{{- if and (eq $who "plugin") (eq (include "kgp.dra" $root) "true") -}}
{{- $kept := list -}}
{{- range $terms -}}
{{- $kept = append $kept (dict "matchExpressions" (append .matchExpressions (dict "key" "gpu-passthrough.kubevirt.io/dra" "operator" "NotIn" "values" (list "true")))) -}}
{{- end -}}
{{- $terms = $kept -}}
{{- end -}}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
{{- toYaml $terms | nindent 8 }}
{{- end -}}

{{/*
kustomize's configMapGenerator name suffix: the first 10 hex digits of the sha256 of the JSON {"data": …,
"kind": "ConfigMap", "name": ""} (keys sorted; the name is empty in kustomize's own hasher, which looks up
"metadata/name" as one key), 0 1 3 a e mapped to g h k m t. docs/helm.md, "The ConfigMap's name".
*/}}
{{- define "kgp.kustomizeHash" -}}
{{- $json := dict "data" . "kind" "ConfigMap" "name" "" | toJson -}}
{{- sha256sum $json | trunc 10 | replace "0" "g" | replace "1" "h" | replace "3" "k" | replace "a" "m" | replace "e" "t" -}}
{{- end -}}

{{- define "kgp.vgpuConfigData" -}}
{{- dict "config.yaml" (.Files.Get "files/vgpu-config.yaml") "selected" .Values.vgpuDeviceManager.config.default | toJson -}}
{{- end -}}

{{- define "kgp.vgpuConfigMapName" -}}
{{- if .Values.vgpuDeviceManager.config.name -}}
{{- .Values.vgpuDeviceManager.config.name -}}
{{- else -}}
{{- printf "gpu-node-agent-vgpu-%s" (include "kgp.kustomizeHash" (include "kgp.vgpuConfigData" . | fromJson)) -}}
{{- end -}}
{{- end -}}

{{- define "kgp.workloadsConfigData" -}}
{{- dict "workloads.yaml" (.Files.Get "files/workloads.yaml") | toJson -}}
{{- end -}}
