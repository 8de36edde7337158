{{- define "rljob-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rljob-operator.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rljob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rljob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rljob-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Rules for the namespaced resources the operator reads and writes (a ClusterRole or per-namespace Roles). */}}
{{- define "rljob-operator.namespacedRules" -}}
# RLTrainingJobs: kopf lists, watches and annotates them (and holds a finalizer); the TTL deletes them.
- apiGroups: ["rljob.dev"]
  resources: ["rltrainingjobs"]
  verbs: ["list", "watch", "patch", "delete"]
- apiGroups: ["rljob.dev"]
  resources: ["rltrainingjobs/status"]
  verbs: ["patch"]
# Owner references with blockOwnerDeletion on children.
- apiGroups: ["rljob.dev"]
  resources: ["rltrainingjobs/finalizers"]
  verbs: ["update"]
# Trainer and rollout pods: watched (index), created, deleted; read after a name conflict.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
# ConfigMap and Services: server-side apply (create + patch); read back once per job after an operator start, so
# children already as rendered are not applied again. The environment server's Service is deleted when an edit removes
# spec.rollout.environment.server.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch", "delete"]
# The generated Redis password Secret (create-only), the Redis passwords and TLS CA bundles (read for progress).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# Managed Redis and environment servers: server-side apply, watched for readiness, read back once per job after an
# operator start; an environment server's is scaled to 0 while its job cannot run, deleted when an edit removes it.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The environment server's NetworkPolicy (ingress from the job's rollout pods only, egress DNS only): server-side apply,
# read back once per job after an operator start, deleted with the server.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
# The managed Redis's data claim (spec.redis.persistence): created once, read while Redis is not ready (RedisReady
# names a claim that cannot bind), deleted when persistence is switched off.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create", "delete"]
# Events on jobs (kopf posts core/v1 Events); those of the Redis data claim are listed to say why it cannot bind.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list"]
# Kueue (a job with the kueue.x-k8s.io/queue-name label): its Workload is watched (wakes the job), read, created,
# updated (queue, active, priority), replaced when its pod sets change; its status gets the quota back after an
# eviction and Finished at the end.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end -}}
