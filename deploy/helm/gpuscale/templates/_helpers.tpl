{{/*
Names. fullname is the release name when it already holds the chart's name ("gpuscale"),
else "<release>-gpuscale"; every object is "<fullname>-<component>", cut to 63 characters.
*/}}
{{- define "gpuscale.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpuscale.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>": (dict "ctx" $ "component" "scaler") */}}
{{- define "gpuscale.componentName" -}}
{{- printf "%s-%s" (include "gpuscale.fullname" .ctx) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpuscale.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels: (dict "ctx" $ "component" "scaler"); no component for release-wide ones. */}}
{{- define "gpuscale.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuscale.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{- define "gpuscale.labels" -}}
helm.sh/chart: {{ include "gpuscale.chart" .ctx }}
{{ include "gpuscale.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: gpuscale
{{- end -}}

{{- define "gpuscale.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The PriorityClass of placeholder pods: cluster-scoped, so named per release. */}}
{{- define "gpuscale.placeholderPriorityClass" -}}
{{- include "gpuscale.componentName" (dict "ctx" . "component" "placeholder") -}}
{{- end -}}

{{/*
A claim's spec from a persistence section: storageClass "" takes the cluster's default
class, "-" none (a volume bound by hand).
*/}}
{{- define "gpuscale.claimSpec" -}}
accessModes: {{ toYaml .accessModes | nindent 2 }}
resources: {requests: {storage: {{ .size | quote }}}}
{{- if eq .storageClass "-" }}
storageClassName: ""
{{- else if .storageClass }}
storageClassName: {{ .storageClass | quote }}
{{- end }}
{{- end -}}

{{- define "gpuscale.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- define "gpuscale.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{/*
The custom resources a setup writes or reads. Where the cluster does not serve one the
install fails here, naming its CRD, rather than leaving a scaler that fails every pass.
`helm template` knows no cluster: give it `--api-versions <group/version/Kind>`.
*/}}
{{- define "gpuscale.requiredAPIs" -}}
{{- $apis := list -}}
{{- if eq .Values.prePosition "capacityBuffer" -}}
{{- $apis = append $apis "autoscaling.x-k8s.io/v1beta1/CapacityBuffer" -}}
{{- end -}}
{{- if eq .Values.actuator "karpenter" -}}
{{- $apis = append $apis "karpenter.sh/v1/NodePool" -}}
{{- end -}}
{{- range $apis -}}
{{- if not ($.Capabilities.APIVersions.Has .) -}}
{{- fail (printf "the cluster serves no %s: install its CRD first (deploy/README.md), or give helm template --api-versions %s" . .) -}}
{{- end -}}
{{- end -}}
{{- /* Kueue 0.15 and later serve v1beta2 (and, for a while, the deprecated v1beta1); older ones v1beta1: gpuscale reads either. */ -}}
{{- if and .Values.kueue.enabled (not (or (.Capabilities.APIVersions.Has "kueue.x-k8s.io/v1beta2/Workload") (.Capabilities.APIVersions.Has "kueue.x-k8s.io/v1beta1/Workload"))) -}}
{{- fail "the cluster serves no kueue.x-k8s.io/v1beta2/Workload nor v1beta1: install Kueue first (deploy/README.md), or give helm template --api-versions kueue.x-k8s.io/v1beta2/Workload" -}}
{{- end -}}
{{- end -}}

{{/* The cluster's naming conventions, as both live.yaml and collector.yaml take them. */}}
{{- define "gpuscale.clusterNames" -}}
pool_label: {{ .Values.kubernetes.poolLabel | quote }}
gpu_resource: {{ .Values.kubernetes.gpuResource | quote }}
gpu_model_label: {{ .Values.kubernetes.gpuModelLabel | quote }}
{{- end -}}

{{/*
live.yaml: the scaler's and the service's config (scaler/controller/config.py), built from
the values. Other fields: GPUSCALE_* variables in scaler.extraEnv / service.extraEnv.
*/}}
{{- define "gpuscale.liveConfig" -}}
{{- $provider := dict "kind" "aws" "aws" .Values.aws -}}
{{- if eq .Values.actuator "karpenter" -}}
{{- $pools := list -}}
{{- range .Values.karpenter.nodePools -}}
{{- $pools = append $pools (dict "pool" .pool "node_pool" .nodePool) -}}
{{- end -}}
{{- $provider = dict "kind" "karpenter" "karpenter" (dict "node_pools" $pools) -}}
{{- else if eq .Values.actuator "autoscaler" -}}
{{- $provider = dict "kind" "autoscaler" -}}
{{- end -}}
{{- $placeholders := dict "namespace" .Release.Namespace "priority_class" (include "gpuscale.placeholderPriorityClass" .) -}}
{{- $prePosition := get (dict "placeholders" "placeholders" "capacityBuffer" "capacity-buffer" "none" "none") .Values.prePosition -}}
{{- $kubernetes := merge (dict "pre_position" $prePosition "placeholders" $placeholders) (include "gpuscale.clusterNames" . | fromYaml) -}}
{{- if eq .Values.prePosition "capacityBuffer" -}}
{{- $_ := set $kubernetes "capacity_buffers" (dict "namespace" .Release.Namespace) -}}
{{- end -}}
{{- if .Values.kueue.enabled -}}
{{- $_ := set $kubernetes "kueue" true -}}
{{- end -}}
{{- $d := .Values.defrag -}}
{{- $defrag := dict
    "goal" $d.goal
    "max_moves" $d.maxMoves
    "window_s" $d.windowSeconds
    "priority_classes" $d.priorityClasses
    "steer_s" $d.steerSeconds
    "hold_s" $d.holdSeconds
    "mig" (dict "wait_s" $d.mig.waitSeconds "configs" $d.mig.configs)
-}}
{{- $live := dict
    "state_dir" "/var/lib/gpuscale"
    "reconcile_interval_s" .Values.scaler.intervalSeconds
    "pools" .Values.pools
    "provider" $provider
    "kubernetes" $kubernetes
    "demand" (dict "metric" "gpu_demand" "stale_after_s" 300)
    "model" .Values.model
    "policy" .Values.policy
    "lease" (dict "name" (include "gpuscale.componentName" (dict "ctx" . "component" "scaler")) "namespace" .Release.Namespace)
    "service" (dict "token_file" "/var/run/secrets/gpuscale/token" "bind_needs_token" .Values.service.bindNeedsToken)
    "defrag" $defrag
-}}
{{- toYaml $live -}}
{{- end -}}

{{/* collector.yaml: the scaler pod's demand collector (predictor/telemetry/config.py). */}}
{{- define "gpuscale.collectorConfig" -}}
{{- $kubernetes := include "gpuscale.clusterNames" . | fromYaml -}}
{{- if .Values.kueue.enabled -}}
{{- $_ := set $kubernetes "kueue" true -}}
{{- end -}}
{{- toYaml (dict "interval_s" .Values.scaler.intervalSeconds "kubernetes" $kubernetes) -}}
{{- end -}}

{{/* Pod annotations that roll the pods when their config changes. */}}
{{- define "gpuscale.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}
