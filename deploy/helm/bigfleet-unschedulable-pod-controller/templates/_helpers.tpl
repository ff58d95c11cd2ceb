{{- define "bigfleet-upc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "bigfleet-upc.fullname" -}}
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

{{- define "bigfleet-upc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bigfleet-upc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "bigfleet-upc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "bigfleet-upc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: bigfleet
app.kubernetes.io/component: pod-controller
{{- end -}}

{{- define "bigfleet-upc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "bigfleet-upc.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "bigfleet-upc.leaseName" -}}
{{- default (printf "%s-leader" (include "bigfleet-upc.fullname" .)) .Values.leaderElection.leaseName -}}
{{- end -}}

{{- define "bigfleet-upc.validate" -}}
{{- if and (gt (int .Values.replicas) 1) (not .Values.leaderElection.enabled) -}}
{{- fail "replicas > 1 needs leaderElection.enabled: two active controllers would duplicate CapacityRequests" -}}
{{- end -}}
{{- $le := .Values.leaderElection -}}
{{- if and $le.enabled (not (and (gt (float64 $le.leaseDuration) (float64 $le.renewDeadline)) (gt (float64 $le.renewDeadline) (float64 $le.retryPeriod)))) -}}
{{- fail "leaderElection needs leaseDuration > renewDeadline > retryPeriod" -}}
{{- end -}}
{{- end -}}
