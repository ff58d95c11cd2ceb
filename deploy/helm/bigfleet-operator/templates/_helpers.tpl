{{- define "bigfleet-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "bigfleet-operator.fullname" -}}
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

{{- define "bigfleet-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "bigfleet-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: bigfleet
app.kubernetes.io/component: operator
{{- end -}}

{{- define "bigfleet-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bigfleet-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "bigfleet-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "bigfleet-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "bigfleet-operator.leaseName" -}}
{{- default (printf "%s-leader" (include "bigfleet-operator.fullname" .)) .Values.leaderElection.leaseName -}}
{{- end -}}

{{/* Checks the values that have no safe default, so a bad install fails at render time. */}}
{{- define "bigfleet-operator.validate" -}}
{{- if not .Values.clusterID -}}
{{- fail "clusterID is required: the id of this cluster, unique in the fleet" -}}
{{- end -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$" .Values.clusterID) -}}
{{- fail "clusterID must be lower-case letters, digits, '-' and '.' (it is used in names and certificate SANs)" -}}
{{- end -}}
{{- if and .Values.shardAddress .Values.coordinatorAddress -}}
{{- fail "set only one of shardAddress and coordinatorAddress" -}}
{{- end -}}
{{- if not (or .Values.shardAddress .Values.coordinatorAddress) -}}
{{- fail "shardAddress or coordinatorAddress is required: where this cluster's demand is sent" -}}
{{- end -}}
{{- if and (gt (int .Values.replicas) 1) (not .Values.leaderElection.enabled) -}}
{{- fail "replicas > 1 needs leaderElection.enabled: two active operators would fight over one Session" -}}
{{- end -}}
{{- end -}}
