{{/* Names: a release's objects are <fullname>[-part], at most 63 characters. */}}
{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvmesh.routerName" -}}
{{- printf "%s-router" (include "kvmesh.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmesh.poolName" -}}
{{- default (include "kvmesh.fullname" .) .Values.inferencePool.name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvmesh.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvmesh.secretName" -}}
{{- default (printf "%s-keys" (include "kvmesh.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* The chart makes the keys Secret itself when none is given and kvmesh engines need one. */}}
{{- define "kvmesh.createSecret" -}}
{{- if and (not .Values.auth.existingSecret) (eq .Values.modelServer.type "kvmesh") }}true{{ end }}
{{- end }}

{{- define "kvmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvmesh.routerSelectorLabels" -}}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end }}

{{/* Every model server pod, whatever its role: the InferencePool's selector. */}}
{{- define "kvmesh.modelServerSelectorLabels" -}}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/component: model-server
{{- end }}

{{/* The pods' one environment fact all of them share: the hash seed. */}}
{{- define "kvmesh.hashSeedEnv" -}}
- name: PYTHONHASHSEED
  value: {{ .Values.model.hashSeed | quote }}
{{- end }}

{{- define "kvmesh.apiKeyEnv" -}}
{{- if .Values.auth.useApiKey }}
{{- if not .Values.auth.existingSecret }}
{{- fail "auth.useApiKey needs auth.existingSecret (a Secret with key api-key)" }}
{{- end }}
- name: VLLM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.auth.existingSecret }}
      key: api-key
{{- end }}
{{- end }}

{{/* The scheduler preset the router runs when no schedulerConfig is given. */}}
{{- define "kvmesh.preset" -}}
{{- if .Values.router.preset }}{{ .Values.router.preset }}
{{- else if .Values.pd.enabled }}pd
{{- else }}kvmesh
{{- end }}
{{- end }}

{{/* vLLM's --kv-events-config JSON: the PUB socket binds (a wildcard endpoint), replay on a
ROUTER socket; the topic names the pod as llm-d's guides do. */}}
{{- define "kvmesh.kvEventsConfig" -}}
{{- $ev := .Values.modelServer.kvEvents -}}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $ev.port)) "replay_endpoint" (printf "tcp://*:%d" (int $ev.replayPort)) "topic" (printf "kv@$(POD_IP):%d@%s" (int .Values.modelServer.port) .Values.model.servedModelName) | toJson }}
{{- end }}

{{/* vLLM's --kv-transfer-config for a role: NIXL for P/D, an OffloadingConnector for the host
tier, a MultiConnector holding both when both are on; empty when neither. kvmesh engines take
the host tier as --kv-offloading-size instead, so for them only the P/D connector is written. */}}
{{- define "kvmesh.kvTransferConfig" -}}
{{- $v := .Values -}}
{{- $connectors := list -}}
{{- if $v.pd.enabled }}
{{- $connectors = append $connectors (dict "kv_connector" $v.pd.kvConnector "kv_role" "kv_both") }}
{{- end }}
{{- if and $v.modelServer.hostTier.enabled (eq $v.modelServer.type "vllm") }}
{{- $bytes := int (mulf (float64 $v.modelServer.hostTier.sizeGiB) 1073741824) }}
{{- $connectors = append $connectors (dict "kv_connector" "OffloadingConnector" "kv_role" "kv_both" "kv_connector_extra_config" (dict "cpu_bytes_to_use" $bytes)) }}
{{- end }}
{{- if eq (len $connectors) 1 }}
{{- first $connectors | toJson }}
{{- else if gt (len $connectors) 1 }}
{{- dict "kv_connector" "MultiConnector" "kv_role" "kv_both" "kv_connector_extra_config" (dict "connectors" $connectors) | toJson }}
{{- end }}
{{- end }}

{{/* A read-only root filesystem's writable paths: /tmp and HOME, both emptyDirs. HOME holds
what the processes cache (kvmesh's converted tokenizer, HF_HOME, torch, triton, vLLM). */}}
{{- define "kvmesh.homeDir" -}}/home/app{{- end }}

{{- define "kvmesh.writableEnv" -}}
- name: HOME
  value: {{ include "kvmesh.homeDir" . }}
- name: XDG_CACHE_HOME
  value: {{ include "kvmesh.homeDir" . }}/.cache
- name: HF_HOME
  value: {{ include "kvmesh.homeDir" . }}/.cache/huggingface
{{- end }}

{{- define "kvmesh.writableMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: {{ include "kvmesh.homeDir" . }}
{{- end }}

{{/* The volumes, from a dict with the two size limits ("" : unbounded). */}}
{{- define "kvmesh.writableVolumes" -}}
- name: tmp
  emptyDir:
    {{- with .tmp }}
    sizeLimit: {{ . }}
    {{- else }} {}
    {{- end }}
- name: home
  emptyDir:
    {{- with .home }}
    sizeLimit: {{ . }}
    {{- else }} {}
    {{- end }}
{{- end }}

{{/* preStop: the kubelet's sleep action (Kubernetes 1.30+, the chart's kubeVersion), so no
binary is needed in the image; 0 seconds: none. */}}
{{- define "kvmesh.lifecycle" -}}
{{- if gt (int .) 0 }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ int . }}
{{- end }}
{{- end }}

{{/* InferencePool spec.appProtocol, only where the declared CRD release has the field
(v1.4.0 on); with older CRDs only http, their behaviour, can be asked for. */}}
{{- define "kvmesh.poolAppProtocol" -}}
{{- $pool := .Values.inferencePool }}
{{- if semverCompare ">=1.4.0-0" (toString $pool.crdVersion) }}
  appProtocol: {{ $pool.appProtocol }}
{{- else if ne $pool.appProtocol "http" }}
{{- fail (printf "inferencePool.appProtocol %s needs the Inference Extension CRDs v1.4.0 or later (inferencePool.crdVersion is %s)" $pool.appProtocol (toString $pool.crdVersion)) }}
{{- end }}
{{- end }}
