{{/*
Names. KubeRay derives cluster, pod and service names from the RayService name and adds suffixes,
so the full name is kept short.
*/}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
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

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString (default .Chart.AppVersion .Values.image.tag)) }}
{{- end }}

{{/* True ("true") when autoscaling bounds are set; they then replace .Values.replicas. */}}
{{- define "tandem.autoscaling" -}}
{{- $a := .Values.autoscaling | default dict }}
{{- if or (hasKey $a "minReplicas") (hasKey $a "maxReplicas") }}
{{- if not (and (hasKey $a "minReplicas") (hasKey $a "maxReplicas")) }}
{{- fail "autoscaling: set both autoscaling.minReplicas and autoscaling.maxReplicas, or neither" }}
{{- end }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "autoscaling.minReplicas (%d) must be <= autoscaling.maxReplicas (%d)" (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- if not (kindIs "invalid" $a.initialReplicas) }}
{{- if or (lt (int $a.initialReplicas) (int $a.minReplicas)) (gt (int $a.initialReplicas) (int $a.maxReplicas)) }}
{{- fail (printf "autoscaling.initialReplicas (%d) must lie between autoscaling.minReplicas (%d) and autoscaling.maxReplicas (%d)" (int $a.initialReplicas) (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- end }}
{{- "true" }}
{{- end }}
{{- end }}

{{- define "tandem.hfTokenSecret" -}}
{{- if .Values.hfToken.existingSecret }}
{{- .Values.hfToken.existingSecret }}
{{- else if .Values.hfToken.value }}
{{- printf "%s-hf-token" (include "tandem.fullname" .) }}
{{- end }}
{{- end }}

{{- define "tandem.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value }}
{{- printf "%s-api-key" (include "tandem.fullname" .) }}
{{- end }}
{{- end }}

{{- define "tandem.modelCacheClaim" -}}
{{- default (printf "%s-model-cache" (include "tandem.fullname" .)) .Values.modelCache.pvc.existingClaim }}
{{- end }}

{{/*
The Serve config (serveConfigV2), built as a dict and emitted with toYaml so quoting is always right.
Its args are validated by tandem.deploy.config.args.AppArgs, as for `serve run`.
*/}}
{{- define "tandem.serveConfig" -}}
{{- $v := .Values }}
{{- $e := $v.engine }}
{{- $engine := dict "dtype" $e.dtype "prefix_cache" $e.prefixCache "overlap" $e.overlap "cuda_graph" $e.cudaGraph "seed" (int $e.seed) "mem_fraction" (float64 $e.memFraction) }}
{{- range $key, $arg := dict "pageSize" "page_size" "chunkSize" "chunk_size" "maxRunning" "max_running" "maxModelLen" "max_model_len" }}
{{- $value := index $e $key }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $engine $arg (int $value) }}
{{- end }}
{{- end }}
{{- $args := dict "model" (required "model is required: a Hugging Face hub id or a path in the image (--set model=...)" $v.model) }}
{{- $_ := set $args "tp_size" (int $v.tensorParallelSize) }}
{{- $_ := set $args "device" "cuda" }}
{{- $_ := set $args "engine" $engine }}
{{- if not (kindIs "invalid" $v.serve.maxOngoingRequests) }}
{{- $_ := set $args "max_ongoing_requests" (int $v.serve.maxOngoingRequests) }}
{{- end }}
{{- if not (kindIs "invalid" $v.serve.maxQueuedRequests) }}
{{- $_ := set $args "max_queued_requests" (int $v.serve.maxQueuedRequests) }}
{{- end }}
{{- $_ := set $args "placement_strategy" $v.serve.placementStrategy }}
{{- $_ := set $args "cpus_per_rank" (float64 $v.serve.cpusPerRank) }}
{{- $_ := set $args "max_request_body_bytes" (int $v.serve.maxRequestBodyBytes) }}
{{- $_ := set $args "max_choices_per_request" (int $v.serve.maxChoicesPerRequest) }}
{{- $_ := set $args "prompt_chars_per_token" (int $v.serve.promptCharsPerToken) }}
{{- $_ := set $args "stuck_rank_timeout_s" (float64 $v.serve.stuckRankTimeoutSeconds) }}
{{- $_ := set $args "allowed_origins" $v.serve.allowedOrigins }}
{{- $_ := set $args "enable_auto_tool_choice" $v.serve.enableAutoToolChoice }}
{{- with $v.serve.toolCallParser }}
{{- $_ := set $args "tool_call_parser" . }}
{{- end }}
{{- with $v.serve.reasoningParser }}
{{- $_ := set $args "reasoning_parser" . }}
{{- end }}
{{- with $v.serve.chatTemplate }}
{{- $_ := set $args "chat_template" . }}
{{- end }}
{{- with $v.servedModelName }}
{{- $_ := set $args "served_model_name" . }}
{{- end }}
{{- with $v.worker.acceleratorType }}
{{- $_ := set $args "accelerator_type" . }}
{{- end }}
{{- if include "tandem.autoscaling" . }}
{{- $a := $v.autoscaling }}
{{- $autoscalingConfig := dict "min_replicas" (int $a.minReplicas) "max_replicas" (int $a.maxReplicas) }}
{{- if not (kindIs "invalid" $a.targetOngoingRequests) }}
{{- $_ := set $autoscalingConfig "target_ongoing_requests" (float64 $a.targetOngoingRequests) }}
{{- end }}
{{- if not (kindIs "invalid" $a.initialReplicas) }}
{{- $_ := set $autoscalingConfig "initial_replicas" (int $a.initialReplicas) }}
{{- end }}
{{- if not (kindIs "invalid" $a.upscaleDelaySeconds) }}
{{- $_ := set $autoscalingConfig "upscale_delay_s" (float64 $a.upscaleDelaySeconds) }}
{{- end }}
{{- if not (kindIs "invalid" $a.downscaleDelaySeconds) }}
{{- $_ := set $autoscalingConfig "downscale_delay_s" (float64 $a.downscaleDelaySeconds) }}
{{- end }}
{{- $_ := set $args "autoscaling_config" $autoscalingConfig }}
{{- else }}
{{- $_ := set $args "num_replicas" (int $v.replicas) }}
{{- end }}
{{- $app := dict "name" $v.serve.applicationName "route_prefix" $v.serve.routePrefix "import_path" "tandem.deploy.app:build_app" "args" $args }}
{{- with $v.serve.runtimeEnv }}
{{- $_ := set $app "runtime_env" . }}
{{- end }}
{{- $config := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" 8000) "applications" (list $app) }}
{{- toYaml $config }}
{{- end }}

{{/* Environment shared by the head and the workers. */}}
{{- define "tandem.env" -}}
{{- /* Ray Serve's proxy wraps its HTTP app in tandem's middleware, which turns a replica dying mid-request
       (or no replica at all) into an OpenAI-shaped 503 or error chunk; every node runs a proxy. */}}
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: "tandem.deploy.routing.proxy_errors:proxy_middlewares"
{{- $secret := include "tandem.hfTokenSecret" . }}
{{- if $secret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .Values.hfToken.secretKey }}
{{- end }}
{{- /* The API keys stay out of the RayService spec (and so out of the Serve config the dashboard shows):
       the app reads TANDEM_API_KEY where it is built. */}}
{{- $apiKeySecret := include "tandem.apiKeySecret" . }}
{{- if $apiKeySecret }}
- name: TANDEM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $apiKeySecret }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- if ne .Values.modelCache.type "none" }}
- name: HF_HOME
  value: {{ .Values.modelCache.mountPath | quote }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "tandem.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if ne .Values.modelCache.type "none" }}
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
{{- end }}
{{- end }}

{{/* Called with (dict "root" $ "shmSize" SIZE). */}}
{{- define "tandem.volumes" -}}
{{- $v := .root.Values -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- if eq $v.modelCache.type "pvc" }}
- name: model-cache
  persistentVolumeClaim:
    claimName: {{ include "tandem.modelCacheClaim" .root }}
{{- else if eq $v.modelCache.type "hostPath" }}
- name: model-cache
  hostPath:
    path: {{ $v.modelCache.hostPath.path }}
    type: {{ $v.modelCache.hostPath.type }}
{{- end }}
{{- end }}

{{/* Pod annotations: the user's plus, when enabled, Prometheus scrape annotations for Ray's metrics port. */}}
{{- define "tandem.podAnnotations" -}}
{{- $annotations := deepCopy (.podAnnotations | default dict) }}
{{- if .root.Values.metrics.prometheusAnnotations }}
{{- $_ := set $annotations "prometheus.io/scrape" "true" }}
{{- $_ := set $annotations "prometheus.io/port" "8080" }}
{{- $_ := set $annotations "prometheus.io/path" "/metrics" }}
{{- end }}
{{- with $annotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* A CPU quantity ("4", "2.5", "500m") in millicores. */}}
{{- define "tandem.millicores" -}}
{{- $q := toString . }}
{{- if hasSuffix "m" $q }}
{{- trimSuffix "m" $q | float64 | int }}
{{- else }}
{{- mulf (float64 $q) 1000 | int }}
{{- end }}
{{- end }}

{{/*
Worker container resources: nvidia.com/gpu is always tensorParallelSize (one TP group per pod);
CPU and memory scale with it unless worker.resources overrides them. Requests equal limits.
*/}}
{{- define "tandem.workerResources" -}}
{{- $v := .Values }}
{{- $tp := int $v.tensorParallelSize }}
{{- $user := $v.worker.resources | default dict }}
{{- $gpu := dict "nvidia.com/gpu" $tp }}
{{- $computed := dict "cpu" (toString (mul $tp $v.worker.cpusPerGpu)) "memory" (printf "%dGi" (mul $tp $v.worker.memoryGiPerGpu)) }}
{{- with $v.worker.ephemeralStorage }}
{{- $_ := set $computed "ephemeral-storage" . }}
{{- end }}
{{- $limits := merge (deepCopy $gpu) (deepCopy ($user.limits | default dict)) $computed }}
{{- $requests := merge (deepCopy $gpu) (deepCopy ($user.requests | default dict)) (deepCopy $limits) }}
{{- $need := addf (mulf $tp $v.serve.cpusPerRank) 1 }}
{{- $have := divf (include "tandem.millicores" $limits.cpu | int) 1000 }}
{{- if lt $have $need }}
{{- fail (printf "worker CPU limit (%v) is below what one replica reserves: tensorParallelSize (%d) x serve.cpusPerRank (%v) + 1 for the replica actor = %v; raise worker.cpusPerGpu or worker.resources.limits.cpu" $limits.cpu $tp $v.serve.cpusPerRank $need) }}
{{- end }}
{{- toYaml (dict "limits" $limits "requests" $requests) }}
{{- end }}

{{/* Head container resources: the user's, plus the ephemeral-storage request unless they set one. */}}
{{- define "tandem.headResources" -}}
{{- $resources := deepCopy (.Values.head.resources | default dict) }}
{{- with .Values.head.ephemeralStorage }}
{{- $requests := $resources.requests | default dict }}
{{- if not (hasKey $requests "ephemeral-storage") }}
{{- $_ := set $requests "ephemeral-storage" . }}
{{- end }}
{{- $_ := set $resources "requests" $requests }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* Startup, readiness and liveness probes on Serve's /health (port 8000; every node runs a proxy). */}}
{{- define "tandem.probes" -}}
{{- $p := .Values.probes }}
{{- if $p.enabled }}
startupProbe:
  httpGet:
    path: /health
    port: 8000
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ int $p.startupFailureThreshold }}
readinessProbe:
  httpGet:
    path: /health
    port: 8000
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: {{ int $p.readinessFailureThreshold }}
livenessProbe:
  httpGet:
    path: /health
    port: 8000
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ int $p.livenessFailureThreshold }}
{{- end }}
{{- end }}
