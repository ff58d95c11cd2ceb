{{/* Chart name, overridable. */}}
{{- define "bigfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped base name; "bigfleet" for `helm install bigfleet`. Kept short so that
     "<base>-shard-<i>-<ordinal>" stays a valid DNS label. */}}
{{- define "bigfleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "bigfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "bigfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: bigfleet
{{- end -}}

{{- define "bigfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bigfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "bigfleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "bigfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "bigfleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* In-cluster DNS suffix: "<namespace>.svc.<clusterDomain>". */}}
{{- define "bigfleet.svcSuffix" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "bigfleet.coordinator.name" -}}
{{- printf "%s-coordinator" (include "bigfleet.fullname" .) -}}
{{- end -}}

{{/* Client address of the coordinator group (a ClusterIP Service over ready replicas). */}}
{{- define "bigfleet.coordinator.address" -}}
{{- printf "%s.%s:%d" (include "bigfleet.coordinator.name" .) (include "bigfleet.svcSuffix" .) (int .Values.coordinator.service.grpcPort) -}}
{{- end -}}

{{- define "bigfleet.fakeProvider.address" -}}
{{- printf "%s-fake-provider.%s:%d" (include "bigfleet.fullname" .) (include "bigfleet.svcSuffix" .) (int .Values.fakeProvider.port) -}}
{{- end -}}

{{/* Provider address every shard dials; fails the render when none is configured. With
shard.providers set it is empty: bigfleet.providerFlags renders one --provider per entry. */}}
{{- define "bigfleet.providerAddress" -}}
{{- if .Values.shard.providers -}}
{{- if .Values.shard.provider.address -}}
{{- fail "set shard.provider.address or shard.providers, not both" -}}
{{- end -}}
{{- else if .Values.shard.provider.address -}}
{{- .Values.shard.provider.address -}}
{{- else if .Values.fakeProvider.enabled -}}
{{- include "bigfleet.fakeProvider.address" . -}}
{{- else -}}
{{- fail "shard.provider.address is required (or set fakeProvider.enabled=true for a demo install)" -}}
{{- end -}}
{{- end -}}

{{/* The shard's --provider flags, one per line: the single address, or NAME=ADDRESS for every entry of
shard.providers (one pool across providers, docs/shard.md). */}}
{{- define "bigfleet.providerFlags" -}}
{{- if .Values.shard.providers -}}
{{- $seen := dict -}}
{{- range $p := .Values.shard.providers -}}
{{- if not (regexMatch "^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$" (toString $p.name)) -}}
{{- fail (printf "shard.providers: name %q must be 1-32 lowercase letters, digits or '-'" (toString $p.name)) -}}
{{- end -}}
{{- if hasKey $seen $p.name -}}
{{- fail (printf "shard.providers: name %q is given twice" $p.name) -}}
{{- end -}}
{{- $_ := set $seen $p.name true -}}
{{- $addr := $p.address | default "" -}}
{{- if $p.fakeProvider -}}
{{- if not $.Values.fakeProvider.enabled -}}
{{- fail (printf "shard.providers[%s].fakeProvider needs fakeProvider.enabled=true" $p.name) -}}
{{- end -}}
{{- if $addr -}}
{{- fail (printf "shard.providers[%s]: set address or fakeProvider, not both" $p.name) -}}
{{- end -}}
{{- $addr = include "bigfleet.fakeProvider.address" $ -}}
{{- end -}}
{{- if not $addr -}}
{{- fail (printf "shard.providers[%s].address (host:port) is required" $p.name) -}}
{{- end }}
--provider={{ $p.name }}={{ $addr }}
{{- end -}}
{{- else }}
--provider={{ include "bigfleet.providerAddress" . }}
{{- end -}}
{{- end -}}

{{/*
Shell start-up for a Raft replica. Kubernetes gives every replica the same pod template, but each
one must be told the *other* members' addresses; the rendered list holds all members and the
script drops the pod's own entry (matched on its stable pod name) before exec'ing the daemon.
Arguments: dict with "members" (list of host:port), "exec" (the command line, already quoted).
*/}}
{{- define "bigfleet.raftLauncher" -}}
set -eu
peers=""
for member in {{ join " " .members }}; do
  case "$member" in
    "${POD_NAME}."*) ;;
    *) peers="${peers:+$peers,}$member" ;;
  esac
done
exec {{ .exec }} --raft-peers="$peers"
{{- end -}}

{{- define "bigfleet.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end -}}

{{- define "bigfleet.raftSecretName" -}}
{{- default (printf "%s-raft" (include "bigfleet.fullname" .)) .Values.raft.existingSecret -}}
{{- end -}}

{{- define "bigfleet.raftPasswordEnv" -}}
- name: BIGFLEET_RAFT_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "bigfleet.raftSecretName" . }}
      key: password
{{- end -}}

{{- define "bigfleet.logArgs" -}}
--log-level={{ .Values.logLevel }} --log-format={{ .Values.logFormat }}
{{- end -}}

{{/* TLS flags for a daemon whose Secret is mounted at /etc/bigfleet/tls. */}}
{{- define "bigfleet.tlsArgs" -}}
--tls-cert=/etc/bigfleet/tls/tls.crt --tls-key=/etc/bigfleet/tls/tls.key --tls-ca=/etc/bigfleet/tls/ca.crt
{{- end -}}
