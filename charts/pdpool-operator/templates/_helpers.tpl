{{- define "pdpool-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdpool-operator.serviceAccountName" -}}
{{- default (include "pdpool-operator.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "pdpool-operator.selectorLabels" -}}
app.kubernetes.io/name: pdpool-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdpool-operator.labels" -}}
{{ include "pdpool-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/*
The namespaces the operator watches: watchNamespaces, else the release's own (a
namespaced install, the default). Empty when watchAllNamespaces (a ClusterRole).
*/}}
{{- define "pdpool-operator.namespaces" -}}
{{- if not .Values.watchAllNamespaces -}}
{{- if .Values.watchNamespaces -}}
{{- toJson .Values.watchNamespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{/*
The operator's permissions, shared by the ClusterRole and the per-namespace Roles.
Each rule names the call that needs it; nothing else is granted.
*/}}
{{- define "pdpool-operator.rules" -}}
# watch pools; kopf keeps its handler progress in the pools' annotations (patch)
- apiGroups: [pdpool.io]
  resources: [pdinferencepools]
  verbs: [get, list, watch, patch]
# conditions, observedGeneration, ready replicas
- apiGroups: [pdpool.io]
  resources: [pdinferencepools/status]
  verbs: [patch]
# server-side apply of the children (create when absent); watch for status
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, patch]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [create, patch]
# a PodDisruptionBudget per role and the pool's NetworkPolicies (server-side apply)
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, patch]
# each pool's KV-signing Secret, created once when absent: an existing one answers 409
# and is left alone, so no Secret is ever read (no get/list/watch) or changed (no patch)
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# Warning events on pools whose spec cannot be honoured; Normal ones on each autoscaling change
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# autoscaling (planner): the pool's pods, whose /metrics the planner reads
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
# autoscaling (mode hpa / keda): a HorizontalPodAutoscaler / KEDA ScaledObject per role
# (server-side apply); another mode's are deleted when the mode changes
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete]
# spec.inferencePool: the EPP's ServiceAccount (it mounts no token and has no role), the
# InferencePool (get: its parents' conditions for the pool's status) and the HTTPRoute
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [create, patch]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [create, patch]
# spec.loras rollouts: GIE's InferenceModelRewrite (deleted once no adapter has a rollout)
- apiGroups: [inference.networking.x-k8s.io]
  resources: [inferencemodelrewrites]
  verbs: [get, create, patch, delete]
{{- end -}}
