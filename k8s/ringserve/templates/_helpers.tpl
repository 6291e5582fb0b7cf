{{/* Names: <fullname>-<component>; fullname is capped so "-scheduler-headless" still fits in 63. */}}
{{- define "ringserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "ringserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ringserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels for everything; call with (dict "ctx" $ "component" "scheduler"). */}}
{{- define "ringserve.labels" -}}
helm.sh/chart: {{ include "ringserve.chart" .ctx }}
{{ include "ringserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: ringserve
{{- end }}

{{- define "ringserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ringserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end }}

{{- define "ringserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ringserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image for a component; call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "ringserve.image" -}}
{{- printf "%s/%s:%s" .ctx.Values.image.repository .component (default .ctx.Chart.AppVersion .ctx.Values.image.tag) }}
{{- end }}

{{- define "ringserve.hfSecretName" -}}
{{- if .Values.hfToken.existingSecret }}
{{- .Values.hfToken.existingSecret }}
{{- else }}
{{- printf "%s-hf-token" (include "ringserve.fullname" .) }}
{{- end }}
{{- end }}

{{- define "ringserve.modelCacheClaim" -}}
{{- if .Values.modelCache.persistence.existingClaim }}
{{- .Values.modelCache.persistence.existingClaim }}
{{- else }}
{{- printf "%s-model-cache" (include "ringserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* Target of a component's gRPC Service inside the cluster. */}}
{{- define "ringserve.detokenizerTarget" -}}
{{- printf "%s-detokenizer:%d" (include "ringserve.fullname" .) (int .Values.detokenizer.port) }}
{{- end }}

{{- define "ringserve.schedulerTarget" -}}
{{- printf "dns:///%s-scheduler-headless.%s.svc.cluster.local:%d" (include "ringserve.fullname" .) .Release.Namespace (int .Values.scheduler.port) }}
{{- end }}

{{- define "ringserve.tokenizerTarget" -}}
{{- if .Values.gateway.tokenizerTarget }}
{{- .Values.gateway.tokenizerTarget }}
{{- else }}
{{- printf "dns:///%s-tokenizer-headless.%s.svc.cluster.local:%d" (include "ringserve.fullname" .) .Release.Namespace (int .Values.tokenizer.port) }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by every component. */}}
{{- define "ringserve.podSpecCommon" -}}
serviceAccountName: {{ include "ringserve.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* Env for the model-loading services: model cache, HF token, writable HOME. */}}
{{- define "ringserve.env" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: RINGSERVE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
{{ include "ringserve.hubEnv" . }}
{{- include "ringserve.tlsEnv" . }}
{{- end }}

{{- define "ringserve.hubEnv" -}}
- name: HF_HOME
  value: {{ .Values.modelCache.mountPath | quote }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "ringserve.hfSecretName" . }}
      key: {{ .Values.hfToken.key }}
      optional: true
{{- end }}

{{/* The model-loading services read the model their pod's init container prepared (ringserve.modelInit). */}}
{{- define "ringserve.preparedModel" -}}
/prepared/model
{{- end }}

{{- define "ringserve.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
- name: model
  mountPath: /prepared
  readOnly: true
{{- include "ringserve.tlsVolumeMount" . }}
{{- end }}

{{/* The name the API serves the model under: servedModelName, else SmolLM2-135M-Instruct for the
images' default model, else `model` as given. */}}
{{- define "ringserve.servedModelName" -}}
{{- if .Values.servedModelName }}
{{- .Values.servedModelName }}
{{- else if eq .Values.model "/models/default" }}
{{- "SmolLM2-135M-Instruct" }}
{{- else }}
{{- .Values.model }}
{{- end }}
{{- end }}

{{/* Model preparation, the first (init) container of every pod that loads the model: `python -m
ringserve.model_source MODEL --out /prepared/model` into the pod's `model` emptyDir, with the scheduler-cpu
image (torch: it dequantizes a GGUF; the tokenizer and detokenizer images have none). A model directory is
copied, a hub model downloaded (HF_HOME), a GGUF converted under /app/.cache (the same emptyDir). A model
that cannot be served fails it with one line `error: ...`, and the pod's service never starts. */}}
{{- define "ringserve.modelInit" -}}
- name: model-init
  image: {{ include "ringserve.image" (dict "ctx" . "component" "scheduler-cpu") }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["python", "-m", "ringserve.model_source"]
  args:
    - {{ .Values.model | quote }}
    - --out
    - {{ include "ringserve.preparedModel" . }}
  env:
    - name: HOME
      value: /tmp
    - name: XDG_CACHE_HOME
      value: /tmp/.cache
    {{- include "ringserve.hubEnv" . | nindent 4 }}
  resources:
    {{- toYaml .Values.modelInit.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: model-cache
      mountPath: {{ .Values.modelCache.mountPath }}
    - name: model
      mountPath: /prepared
    - name: model
      mountPath: /app/.cache
      subPath: conversion
    {{- if .Values.modelVolume }}
    - name: host-models
      mountPath: /models/host
      readOnly: true
    {{- end }}
{{- end }}

{{/* TLS (values.tls): the Secret's files at /etc/ringserve/tls and the RINGSERVE_TLS_* env naming them. */}}
{{- define "ringserve.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/ringserve/tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "ringserve.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled" .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "ringserve.tlsEnv" -}}
{{- if .Values.tls.enabled }}
{{- range $var, $file := dict "CERT" "server.crt" "KEY" "server.key" "CA" "ca.crt" "CLIENT_CERT" "client.crt" "CLIENT_KEY" "client.key" }}
- name: RINGSERVE_TLS_{{ $var }}
  value: /etc/ringserve/tls/{{ $file }}
{{- end }}
{{- with .Values.tls.serverName }}
- name: RINGSERVE_TLS_SERVER_NAME
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ringserve.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
- name: model
  emptyDir:
    sizeLimit: {{ .Values.modelInit.sizeLimit }}
{{- with .Values.modelVolume }}
- name: host-models
  {{- toYaml . | nindent 2 }}
{{- end }}
- name: model-cache
{{- if .Values.modelCache.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "ringserve.modelCacheClaim" . }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.modelCache.emptyDir.sizeLimit }}
{{- end }}
{{- include "ringserve.tlsVolume" . }}
{{- end }}

{{/* gRPC health startup/readiness/liveness probes: the kubelet's native grpc probe, or with TLS on an exec
probe running the project's own (it reads the RINGSERVE_TLS_* env); call with
(dict "port" 50052 "spec" .Values.scheduler "tls" .Values.tls.enabled). */}}
{{- define "ringserve.grpcProbes" -}}
{{- $ctx := . }}
{{- range $probe := list "startupProbe" "readinessProbe" "livenessProbe" }}
{{ $probe }}:
  {{- if $ctx.tls }}
  exec:
    command: ["python", "-m", "ringserve.probe", "127.0.0.1:{{ $ctx.port }}", "--timeout", "1"]
  {{- else }}
  grpc:
    port: {{ $ctx.port }}
  {{- end }}
  {{- toYaml (get $ctx.spec $probe) | nindent 2 }}
{{- end }}
{{- end }}

{{/* preStop: stay up while the endpoint removal propagates, then SIGTERM drains in-flight work. */}}
{{- define "ringserve.lifecycle" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ . }}"]
{{- end }}

{{- define "ringserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "ringserve.podAnnotations" -}}
{{- with .Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
