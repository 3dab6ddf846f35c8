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
live.yaml: the scaler's and the service's config (scaler/controller/config.py), built from
the values. Other fields: GPUSCALE_* variables in scaler.extraEnv / service.extraEnv.
*/}}
{{- define "gpuscale.liveConfig" -}}
{{- $placeholders := dict "namespace" .Release.Namespace "priority_class" (include "gpuscale.placeholderPriorityClass" .) -}}
{{- $live := dict
    "state_dir" "/var/lib/gpuscale"
    "reconcile_interval_s" .Values.scaler.intervalSeconds
    "pools" .Values.pools
    "provider" (dict "kind" "aws" "aws" .Values.aws)
    "kubernetes" (dict "pre_position" (eq .Values.prePosition "placeholders") "placeholders" $placeholders)
    "demand" (dict "metric" "gpu_demand" "stale_after_s" 300)
    "model" .Values.model
    "policy" .Values.policy
    "lease" (dict "name" (include "gpuscale.componentName" (dict "ctx" . "component" "scaler")) "namespace" .Release.Namespace)
    "service" (dict "token_file" "/var/run/secrets/gpuscale/token" "bind_needs_token" .Values.service.bindNeedsToken)
-}}
{{- toYaml $live -}}
{{- end -}}

{{/* collector.yaml: the scaler pod's demand collector (predictor/telemetry/config.py). */}}
{{- define "gpuscale.collectorConfig" -}}
{{- toYaml (dict "interval_s" .Values.scaler.intervalSeconds "kubernetes" (dict)) -}}
{{- end -}}

{{/* Pod annotations that roll the pods when their config changes. */}}
{{- define "gpuscale.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}
