{{/* Name of the chart's objects: the release name when it already says spotguard, else
release-spotguard (as `helm create` does); fullnameOverride wins. */}}
{{- define "spotguard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object: the kustomize base's app.kubernetes.io/name plus Helm's own. */}}
{{- define "spotguard.labels" -}}
app.kubernetes.io/name: spotguard
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | quote }}
{{- end -}}

{{/* The agent pods' selector: the same as the kustomize base's. */}}
{{- define "spotguard.selectorLabels" -}}
app.kubernetes.io/name: spotguard
app.kubernetes.io/component: agent
{{- end -}}

{{/* The ServiceAccount's name, and the namespace, as the own-node policy's CEL expression and
the ClusterRoleBinding's subject name them: a name Kubernetes would refuse (a stray space, say)
matches no request and switches the policy off silently, so it fails the render instead (the
schema's patterns catch the values; this catches the release namespace and the default too). */}}
{{- define "spotguard.serviceAccountName" -}}
{{- $name := "" -}}
{{- if .Values.serviceAccount.create -}}
{{- $name = default (include "spotguard.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- $name = required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" $name) -}}
{{- fail (printf "serviceAccount.name %q is not a Kubernetes name (DNS-1123 subdomain: lower-case letters, digits, '-' and '.')" $name) -}}
{{- end -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .Release.Namespace) -}}
{{- fail (printf "namespace %q is not a Kubernetes namespace name (DNS-1123 label)" .Release.Namespace) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* repository:tag, or repository@digest when a digest is given. */}}
{{- define "spotguard.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* prefetch.datasets as NAME=URL,NAME=URL (sorted by name). */}}
{{- define "spotguard.datasets" -}}
{{- $pairs := list -}}
{{- range $name, $url := . -}}
{{- $pairs = append $pairs (printf "%s=%s" $name $url) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
