{{/* Names are cut at 63 characters: some Kubernetes name fields are DNS labels. */}}
{{- define "hicache-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hicache-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Cluster-scoped objects also carry the release namespace: two releases of the same
name in different namespaces must not share a ClusterRole. */}}
{{- define "hicache-operator.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "hicache-operator.fullname" .) | trunc 253 | trimSuffix "-" }}
{{- end }}

{{- define "hicache-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hicache-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "hicache-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hicache-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "hicache-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "hicache-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hicache
{{- end }}

{{- define "hicache-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* In processBacked mode the operator runs as a process on a shared machine, so it binds
its pod IP; elsewhere it binds every address, which `kubectl port-forward` needs. */}}
{{- define "hicache-operator.bindHost" -}}
{{- if .Values.processBacked }}$(POD_IP){{ else }}0.0.0.0{{ end }}
{{- end }}

{{/*
Every namespaced permission the operator uses, derived from hicache_operator/ (kube.py,
swap.py, handlers.py) and kopf. Nothing else: no deletes but pods, no updates, no
reads of objects it only writes.
*/}}
{{- define "hicache-operator.namespacedRules" -}}
# kopf watches HiCacheDeployments (no finalizer, no annotations: nothing to patch);
# workers re-read one by name (kube.get_deployment).
- apiGroups: [hicache.dev]
  resources: [hicachedeployments]
  verbs: [get, list, watch]
# kube.replace_deployment_status writes status through the status subresource.
- apiGroups: [hicache.dev]
  resources: [hicachedeployments/status]
  verbs: [patch]
# Children are server-side applied (PATCH; creating through apply also needs create);
# the StatefulSet is read back to see which pod template it carries.
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [create, patch]
# The router (Deployment, its Service of the pods in serving, ServiceAccount, Role, RoleBinding)
# and a managed Mooncake master (Deployment + Service) are watched for their readiness and
# deleted when the spec stops asking for them.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [create, patch, delete]
# The router's Role grants its ServiceAccount list and watch on pods in its namespace; the API
# server lets the operator grant only what it holds itself (it does: see pods below).
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch]
# The admin Secret is created once and never rewritten; its existence is checked first,
# and backend swaps read its key to call the runtime's admin API.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# modelSource claims (the download cache, a pvc source) are read for their access modes:
# a claim one node attaches cannot serve a multi-node fleet.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get]
# kopf watches managed pods; kube.pods lists them; pods on a stale template are deleted; the
# hicache.dev/serving label takes a pod out of serving and back (with a readmission, the pod's
# storage annotations travel in the same patch).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, patch, delete]
# Backend swaps gate on routability: is the pod's endpoint ready in its Service's slices?
# (watched, so a swap step follows each endpoint change at once)
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
# Events on HiCacheDeployments (ours and kopf's).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}

{{/* Always cluster-wide: nodes are cluster-scoped, and so are CRDs. */}}
{{- define "hicache-operator.clusterRules" -}}
# Sizing reads node allocatable memory, labels and taints (kopf index + watch).
- apiGroups: [""]
  resources: [nodes]
  verbs: [list, watch]
# kopf's resource observer: notices the HiCacheDeployment CRD being installed or changed
# after the operator started (without it, kopf only scans at startup and logs a warning).
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if .Values.watchNamespaces }}
# With --namespace, kopf lists and watches namespaces to learn which of the named ones
# exist. Denied, it retries for about a minute at every start, serving nothing, before
# assuming they all exist. Namespace names only; nothing inside them.
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- end }}
