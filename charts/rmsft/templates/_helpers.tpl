{{- define "rmsft.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rmsft.labels" -}}
app.kubernetes.io/name: rmsft
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rmsft.selectorLabels" -}}
app.kubernetes.io/name: rmsft
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "rmsft.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rmsft.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rmsft.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The namespaces the operator watches and gets a Role in (rbac.clusterWide false): the release namespace and
     rbac.watchNamespaces, as a JSON list. With clusterWide: watchNamespaces only (empty: every namespace). */}}
{{- define "rmsft.namespaces" -}}
{{- $ns := list -}}
{{- if not .Values.rbac.clusterWide -}}
{{- $ns = append $ns .Release.Namespace -}}
{{- end -}}
{{- range .Values.rbac.watchNamespaces -}}
{{- $ns = append $ns . -}}
{{- end -}}
{{- $ns | uniq | toJson -}}
{{- end -}}

{{/* Rules the operator needs inside a namespace: no delete anywhere (children are garbage
     collected through owner references), no list/watch on Secrets/ConfigMaps/Services. */}}
{{- define "rmsft.namespacedRules" -}}
- apiGroups: ["rmsft.io"]
  resources: ["rolloutmatchingjobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["rmsft.io"]
  resources: ["rolloutmatchingjobs/status"]
  verbs: ["get", "patch"]
# Owner references with blockOwnerDeletion need this where OwnerReferencesPermissionEnforcement is on.
- apiGroups: ["rmsft.io"]
  resources: ["rolloutmatchingjobs/finalizers"]
  verbs: ["update"]
# Secrets: create only, never get or list (no Secret of the namespace is readable): the operator makes each job's
# own token Secret once and never reads it back (reconcile.observe; the TLS Secret is mounted by the kubelet).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
# Learner pods: found by label to read training progress from their /metrics. delete: mid-run, a replacement
# learner pod that cannot start for spec.rollout.startupTimeout is retried (only that pod, by uid; the Job counts it).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "delete"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch"]
# delete: the learner Job of a job whose learner runs on several pods (spec.learner.nodes > 1), once an attempt has
# failed, so that the next attempt's pods start together (only its own Job, by uid).
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create"]
# The pool's and the learner's disruption budgets (spec.rollout.disruptionBudget, spec.learner.disruptionBudget).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
# FailedCreate events of the job's StatefulSet/Job: why pods could not be created (a condition says it).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["list"]
# The job's own namespace, for its Pod Security level (a job with spec.sync.transport shm needs a
# hostPath volume). In a Role this grants the Role's namespace only: the API server authorizes
# GET /api/v1/namespaces/NAME as a request in namespace NAME.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get"]
{{- end -}}
