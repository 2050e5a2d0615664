{{/* Prefix of every object's name: namePrefix, else the release name. */}}
{{- define "xdp-lb.prefix" -}}
{{- default .Release.Name .Values.namePrefix | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Namespace of the LoadBalancer objects (CLUSTER_NAMESPACE). */}}
{{- define "xdp-lb.lbNamespace" -}}
{{- default .Release.Namespace .Values.loadBalancerNamespace -}}
{{- end -}}

{{- define "xdp-lb.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Labels of one component; call with (dict "root" $ "component" "cloud-controller"). */}}
{{- define "xdp-lb.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "xdp-lb.labels" -}}
{{ include "xdp-lb.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/*
The container and pod settings both controllers share; call with (dict "root" $ "component" "…" "values" <its values>
"args" (list …) "env" (list …)).
*/}}
{{- define "xdp-lb.pod" -}}
{{- $root := .root -}}
metadata:
  labels:
    {{- include "xdp-lb.selectorLabels" . | nindent 4 }}
  {{- with $root.Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "xdp-lb.prefix" $root }}-{{ .component }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    runAsGroup: 65532
    seccompProfile:
      type: RuntimeDefault
  containers:
  - name: controller
    image: {{ include "xdp-lb.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    {{- $common := list "--leader-elect" (printf "--log-format=%s" $root.Values.logFormat) (printf "--metrics-bind-address=:%v" $root.Values.ports.metrics) (printf "--health-probe-bind-address=:%v" $root.Values.ports.probes) }}
    args:
    {{- range concat .args $common .values.extraArgs }}
    - {{ . | quote }}
    {{- end }}
    env:
    # The leader-election identity.
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    - name: CLUSTER_NAMESPACE
      value: {{ include "xdp-lb.lbNamespace" $root }}
    {{- with .env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with .values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    ports:
    - name: metrics
      containerPort: {{ $root.Values.ports.metrics }}
    - name: probes
      containerPort: {{ $root.Values.ports.probes }}
    livenessProbe:
      httpGet:
        path: /healthz
        port: probes
    readinessProbe:
      httpGet:
        path: /readyz
        port: probes
    {{- with .values.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    securityContext:
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      capabilities:
        drop: ["ALL"]
    {{- with .mounts }}
    volumeMounts:
      {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .volumes }}
  volumes:
    {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- with $root.Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* The metrics Service and ServiceMonitor of one component; same arguments as xdp-lb.labels. */}}
{{- define "xdp-lb.monitoring" -}}
{{- $root := .root -}}
{{- if $root.Values.metrics.serviceMonitor.enabled }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ include "xdp-lb.prefix" $root }}-{{ .component }}-metrics
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "xdp-lb.labels" . | nindent 4 }}
spec:
  selector:
    {{- include "xdp-lb.selectorLabels" . | nindent 4 }}
  ports:
  - name: metrics
    port: {{ $root.Values.ports.metrics }}
    targetPort: metrics
---
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "xdp-lb.prefix" $root }}-{{ .component }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "xdp-lb.labels" . | nindent 4 }}
    {{- with $root.Values.metrics.serviceMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "xdp-lb.selectorLabels" . | nindent 6 }}
  namespaceSelector:
    matchNames: [{{ $root.Release.Namespace }}]
  endpoints:
  - port: metrics
    path: /metrics
    interval: {{ $root.Values.metrics.serviceMonitor.interval }}
{{- end }}
{{- end -}}
