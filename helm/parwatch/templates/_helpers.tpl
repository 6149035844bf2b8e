{{/* Names ---------------------------------------------------------------------------------- */}}

{{- define "parwatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name; pod hostnames add "-INDEX", so keep room under DNS's 63 characters. */}}
{{- define "parwatch.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "parwatch.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels: selectors use only name and instance. */}}
{{- define "parwatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "parwatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Standard labels; call with (dict "ctx" $ "component" "training"). */}}
{{- define "parwatch.labels" -}}
{{- $ctx := .ctx -}}
helm.sh/chart: {{ include "parwatch.chart" $ctx }}
{{ include "parwatch.selectorLabels" $ctx }}
app.kubernetes.io/version: {{ $ctx.Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: parwatch
app.kubernetes.io/managed-by: {{ $ctx.Release.Service }}
{{- with $ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Images: per-container overrides fall back to .Values.image, the tag to the appVersion. */}}
{{- define "parwatch.image" -}}
{{- $img := merge (deepCopy .override) .ctx.Values.image -}}
{{- printf "%s:%s" $img.repository (default .ctx.Chart.AppVersion $img.tag) }}
{{- end }}

{{- define "parwatch.pullPolicy" -}}
{{- default .ctx.Values.image.pullPolicy .override.pullPolicy }}
{{- end }}

{{/* Control token ---------------------------------------------------------------------------- */}}

{{- /* Writes are always authenticated: without existingSecret or value the chart generates the
token Secret (secret-token.yaml). Kept as a helper so the templates read as before. */}}
{{- define "parwatch.tokenEnabled" -}}true{{- end }}

{{- define "parwatch.tokenSecretName" -}}
{{- default (printf "%s-token" (include "parwatch.fullname" .)) .Values.sidecar.token.existingSecret }}
{{- end }}

{{- define "parwatch.tokenSecretKey" -}}
{{- if .Values.sidecar.token.existingSecret }}{{ .Values.sidecar.token.existingSecretKey }}{{ else }}token{{ end }}
{{- end }}

{{- define "parwatch.tokenDir" -}}/var/run/secrets/parwatch{{- end }}

{{- define "parwatch.controlEndpoint" -}}
http://127.0.0.1:{{ .Values.sidecar.controlPort }}
{{- end }}

{{/* Settings that relate to each other, checked once with messages that name the fix. */}}
{{- define "parwatch.validate" -}}
{{- $s := .Values.sidecar }}
{{- if and $s.token.existingSecret $s.token.value }}
{{- fail "set one of sidecar.token.existingSecret and sidecar.token.value, not both" }}
{{- end }}
{{- if eq (int $s.metricsPort) (int $s.controlPort) }}
{{- fail (printf "sidecar.metricsPort and sidecar.controlPort are both %v; give them different ports" $s.metricsPort) }}
{{- end }}
{{- if and $s.rules.content $s.rules.existingConfigMap }}
{{- fail "set one of sidecar.rules.content and sidecar.rules.existingConfigMap, not both" }}
{{- end }}
{{- end }}

{{/* Pod 0's stable DNS name, where the leader sidecar runs: Indexed Job pods are JOB-INDEX, JobSet pods
JOBSET-node-0-INDEX, both under the headless Service. */}}
{{- define "parwatch.leaderHost" -}}
{{- $fullname := include "parwatch.fullname" . -}}
{{- ternary (printf "%s-0.%s.%s.svc" $fullname $fullname .Release.Namespace) (printf "%s-node-0-0.%s.%s.svc" $fullname $fullname .Release.Namespace) (eq .Values.workload.kind "IndexedJob") -}}
{{- end }}
