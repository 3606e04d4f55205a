{{/* Names: <fullname>-<service>; fullname is the release name when it contains "mars", else <release>-mars. */}}
{{- define "mars.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains "mars" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-mars" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mars.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: mars
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mars
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "ingress"). */}}
{{- define "mars.selectorLabels" -}}
app.kubernetes.io/name: mars
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "mars.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mars.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "mars.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The six services and the gRPC service each serves (readiness asks for it by name). */}}
{{- define "mars.grpcServices" -}}
ingress: mars.v1.Ingress
state: mars.v1.StateEstimator
memory: mars.v1.Memory
router: mars.v1.Router
dispatch: mars.v1.Dispatch
judge: mars.v1.Judge
{{- end -}}

{{/* The stage consumer groups (mars.topology in the code; tests/chart checks the two agree):
     service -> group -> topics. KEDA scales each stage on these groups' lag. */}}
{{- define "mars.consumerGroups" -}}
state:
  mars-state: [mars.turn.received]
memory:
  mars-memory-view: [mars.turn.state]
  mars-memory-writer: [mars.turn.generated]
router:
  mars-router: [mars.turn.view]
  mars-router-updates: [mars.turn.judged]
dispatch:
  mars-dispatch: [mars.turn.routed]
judge:
  mars-judge: [mars.turn.generated, mars.turn.feedback]
{{- end -}}

{{- define "mars.topics" -}}
- mars.turn.received
- mars.turn.state
- mars.turn.view
- mars.turn.routed
- mars.turn.generated
- mars.turn.tokens
- mars.turn.judged
- mars.turn.feedback
- mars.memory.committed
- mars.deadletter
- mars.control
{{- end -}}

{{- define "mars.secretName" -}}
{{- printf "%s-secrets" (include "mars.fullname" .) -}}
{{- end -}}

{{/* The Secret and key of the tools' Kafka password (hook Jobs, KEDA): with per-service logins the
     operator's KafkaUser Secret, else the one shared login's. */}}
{{- define "mars.kafkaPasswordSecret" -}}
{{- if include "mars.kafkaPerService" . -}}
{{- include "mars.kafkaUser" (list . "operator") -}}
{{- else -}}
{{- default (include "mars.secretName" .) .Values.kafka.sasl.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "mars.kafkaPasswordKey" -}}
{{- ternary .Values.kafka.sasl.perServicePasswordKey .Values.kafka.sasl.passwordKey (eq (include "mars.kafkaPerService" .) "true") -}}
{{- end -}}

{{/* Each service logs in to Kafka as its own principal (mars.kafka_acls), the tools as "operator". */}}
{{- define "mars.kafkaPerService" -}}
{{- if and (include "mars.kafkaUsesSasl" .) .Values.kafka.sasl.perService -}}true{{- end -}}
{{- end -}}

{{/* (list root principal): the principal's Kafka user name, which is also its KafkaUser's name and so
     the Secret Strimzi's User Operator makes with its password. */}}
{{- define "mars.kafkaUser" -}}
{{- $root := index . 0 -}}
{{- printf "%s%s" (default (printf "%s-kafka-" (include "mars.fullname" $root)) $root.Values.kafka.sasl.usernamePrefix) (index . 1) -}}
{{- end -}}

{{/* The tools' Kafka user name (hook Jobs, KEDA). */}}
{{- define "mars.kafkaToolsUser" -}}
{{- if include "mars.kafkaPerService" . -}}
{{- include "mars.kafkaUser" (list . "operator") -}}
{{- else -}}
{{- .Values.kafka.sasl.username -}}
{{- end -}}
{{- end -}}

{{/* (list root principal): the container env of a per-service Kafka login (nothing otherwise). */}}
{{- define "mars.kafkaLoginEnv" -}}
{{- $root := index . 0 -}}
{{- if include "mars.kafkaPerService" $root }}
- name: MARS_KAFKA_SASL_USERNAME
  value: {{ include "mars.kafkaUser" . | quote }}
- name: MARS_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "mars.kafkaUser" . }}
      key: {{ $root.Values.kafka.sasl.perServicePasswordKey }}
{{- end }}
{{- end -}}

{{/* The services' kubernetes.io/tls Secret: tls.secretName, else the one the identity Job mints. */}}
{{- define "mars.tlsSecret" -}}
{{- if .Values.tls.secretName -}}
{{- .Values.tls.secretName -}}
{{- else if .Values.tls.mint -}}
{{- printf "%s-tls" (include "mars.fullname" .) -}}
{{- else -}}
{{- fail "tls.secretName is required with tls.enabled and tls.mint=false: a kubernetes.io/tls Secret" -}}
{{- end -}}
{{- end -}}

{{/* The DNS names the minted TLS certificate carries: each service's Service, short and qualified. */}}
{{- define "mars.tlsHosts" -}}
{{- $root := . }}
{{- range $name := keys .Values.services | sortAlpha }}
{{- $svc := printf "%s-%s" (include "mars.fullname" $root) $name }}
- {{ $svc }}
- {{ printf "%s.%s" $svc $root.Release.Namespace }}
- {{ printf "%s.%s.svc" $svc $root.Release.Namespace }}
- {{ printf "%s.%s.svc.%s" $svc $root.Release.Namespace $root.Values.tls.clusterDomain }}
{{- end }}
{{- end -}}

{{/* The Postgres login of a container, (list root login) with login a service, "operator" (the tools) or
     "admin" (the migrate Job, as postgres.user): with postgres.roles, PGUSER <prefix>_<login> and PGPASSWORD
     from the Secret <fullname>-postgres-<login>; libpq reads both (the DSN names no user then). */}}
{{- define "mars.postgresRoleSecret" -}}
{{- $root := index . 0 -}}
{{- printf "%s-postgres-%s" (include "mars.fullname" $root) (index . 1) -}}
{{- end -}}

{{- define "mars.postgresLoginEnv" -}}
{{- $root := index . 0 -}}
{{- $login := index . 1 -}}
{{- if $root.Values.postgres.roles.enabled }}
{{- if eq $login "admin" }}
- name: PGUSER
  value: {{ $root.Values.postgres.user | quote }}
{{- if or $root.Values.postgres.password $root.Values.postgres.existingSecret }}
- name: PGPASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "mars.postgresPasswordSecret" $root }}
      key: {{ $root.Values.postgres.passwordKey }}
{{- end }}
{{- else }}
- name: PGUSER
  value: {{ printf "%s_%s" $root.Values.postgres.roles.prefix $login | quote }}
- name: PGPASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "mars.postgresRoleSecret" (list $root $login) }}
      key: {{ $root.Values.postgres.roles.passwordKey }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The Secret holding the identity CA's certificate (ca.crt), which the stage services trust. */}}
{{- define "mars.identityCaSecret" -}}
{{- printf "%s-identity-ca" (include "mars.fullname" .) -}}
{{- end -}}

{{/* The release's SPIFFE ID prefix (mars.identity): what the stage services accept in a caller's URI SAN.
     Minted here: spiffe://<identity.trustDomain>/ns/<namespace>/<release>; else identity.scope. */}}
{{- define "mars.identityScope" -}}
{{- if .Values.identity.mint -}}
spiffe://{{ .Values.identity.trustDomain }}/ns/{{ .Release.Namespace }}/{{ .Release.Name }}
{{- else -}}
{{- .Values.identity.scope -}}
{{- end -}}
{{- end -}}

{{/* Who holds a service identity (mars.identity.IDENTITIES): the tools, and the ingress (which hands a
     history import's context to the state service). */}}
{{- define "mars.identities" -}}
{{- range $tool := .Values.identity.tools }}
- {{ $tool }}
{{- end }}
- ingress
{{- end -}}

{{/* The Secret holding the master key that wraps users' data keys (eventSealing). */}}
{{- define "mars.masterKeySecret" -}}
{{- default (printf "%s-master-key" (include "mars.fullname" .)) .Values.eventSealing.existingSecret -}}
{{- end -}}

{{- define "mars.postgresPasswordSecret" -}}
{{- default (include "mars.secretName" .) .Values.postgres.existingSecret -}}
{{- end -}}

{{- define "mars.kafkaUsesSasl" -}}
{{- if hasPrefix "SASL_" .Values.kafka.securityProtocol -}}true{{- end -}}
{{- end -}}

{{/* The DSN's TLS parameters: postgres.sslMode, or verify-full where tls.enabled and prefer elsewhere; a
     verifying mode checks against postgres.caSecret's CA (mounted) or the system CAs. */}}
{{- define "mars.postgresSsl" -}}
{{- $mode := .Values.postgres.sslMode | default (ternary "verify-full" "prefer" .Values.tls.enabled) -}}
sslmode={{ $mode }}
{{- if has $mode (list "verify-ca" "verify-full") -}}
&sslrootcert={{ if .Values.postgres.caSecret }}/etc/mars/postgres-tls/{{ .Values.postgres.caKey }}{{ else }}system{{ end }}
{{- end -}}
{{- end -}}

{{- define "mars.kafkaUsesTls" -}}
{{- if and (has .Values.kafka.securityProtocol (list "SSL" "SASL_SSL")) .Values.kafka.tls.caSecret -}}true{{- end -}}
{{- end -}}

{{- define "mars.vllmUrl" -}}
{{- printf "http://%s-vllm:%d/v1" (include "mars.fullname" .) (int .Values.vllm.port) -}}
{{- end -}}

{{/* The settings every service reads under their shared names (ServiceSettings': MARS_<FIELD>, see
     mars.config.env_name), from the chart's values: part of each service's ConfigMap (mars.serviceEnv) and of
     the tools' (mars.commonEnv). */}}
{{- define "mars.sharedEnv" -}}
MARS_KAFKA_BOOTSTRAP: {{ required "kafka.bootstrapServers is required: the external Kafka's host:port list" .Values.kafka.bootstrapServers | quote }}
MARS_KAFKA_PARTITIONS: {{ .Values.kafka.partitions | quote }}
MARS_KAFKA_REPLICATION_FACTOR: {{ .Values.kafka.replicationFactor | quote }}
MARS_TOPIC_PREFIX: {{ .Values.kafka.topicPrefix | quote }}
{{- if and (eq .Values.kafka.securityProtocol "PLAINTEXT") (not .Values.kafka.allowPlaintext) }}
{{- fail "kafka.securityProtocol PLAINTEXT lets anyone who reaches a broker write any topic (plant text in a user's memory, fake feedback) and read every event: use SASL_SSL, or set kafka.allowPlaintext=true to say you accept that" }}
{{- end }}
MARS_KAFKA_SECURITY_PROTOCOL: {{ .Values.kafka.securityProtocol | quote }}
{{- if include "mars.kafkaUsesSasl" . }}
MARS_KAFKA_SASL_MECHANISM: {{ .Values.kafka.sasl.mechanism | quote }}
{{- if not (include "mars.kafkaPerService" .) }}
MARS_KAFKA_SASL_USERNAME: {{ required "kafka.sasl.username is required with a SASL_* securityProtocol and kafka.sasl.perService=false" .Values.kafka.sasl.username | quote }}
{{- end }}
{{- end }}
{{- if include "mars.kafkaUsesTls" . }}
MARS_KAFKA_SSL_CAFILE: /etc/mars/kafka-tls/{{ .Values.kafka.tls.caKey }}
{{- end }}
{{- $pgHost := required "postgres.host is required: the external Postgres server's host name" .Values.postgres.host }}
{{- if .Values.postgres.roles.enabled }}
{{- /* No user in the DSN: each container names its role in PGUSER (mars.postgresLoginEnv). */}}
MARS_POSTGRES_DSN: {{ printf "postgresql://%s:%d/%s?%s" $pgHost (int .Values.postgres.port) .Values.postgres.database (include "mars.postgresSsl" .) | quote }}
{{- else }}
MARS_POSTGRES_DSN: {{ printf "postgresql://%s@%s:%d/%s?%s" .Values.postgres.user $pgHost (int .Values.postgres.port) .Values.postgres.database (include "mars.postgresSsl" .) | quote }}
{{- end }}
MARS_GRPC_HOST: "0.0.0.0"
MARS_GRPC_MAX_CONNECTION_AGE_S: {{ .Values.shutdown.maxConnectionAgeSeconds | quote }}
MARS_METRICS_PORT: {{ .Values.metrics.port | quote }}
{{- if .Values.eventSealing.enabled }}
MARS_MASTER_KEY_FILE: /etc/mars/master-key/{{ .Values.eventSealing.key }}
{{- if .Values.eventSealing.previousSecret }}
MARS_PREVIOUS_MASTER_KEY_FILE: /etc/mars/master-key-previous/{{ .Values.eventSealing.key }}
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
MARS_TLS_CERT_FILE: /etc/mars/tls/tls.crt
MARS_TLS_KEY_FILE: /etc/mars/tls/tls.key
MARS_HEALTH_PORT: {{ .Values.tls.healthPort | quote }}
{{- if .Values.tls.mutual }}
MARS_TLS_CLIENT_CA_FILE: /etc/mars/tls/ca.crt
{{- end }}
{{- end }}
{{- if .Values.identity.enabled }}
MARS_IDENTITY_CA_FILE: /etc/mars/identity-ca/ca.crt
{{- with include "mars.identityScope" . }}
MARS_IDENTITY_SCOPE: {{ . | quote }}
{{- end }}
{{- else }}
MARS_IDENTITY_REQUIRED: "false"
{{- end }}
{{- end -}}

{{/* The tools' settings: the shared ones and the global `env` (the <fullname>-env ConfigMap, which
     `mars deploy replay-job` pods take; the hook Jobs inline the same map). No deployable takes it: each has
     its own (mars.envConfigMap). */}}
{{- define "mars.commonEnv" -}}
{{- include "mars.sharedEnv" . }}
{{- range $k, $v := .Values.env }}
{{ $k }}: {{ $v | quote }}
{{- end }}
{{- end -}}

{{/* The settings sections of the deployables (mars.config.SECTIONS): a deployable's own settings are
     MARS_<SECTION>_<FIELD>, its section being its name. */}}
{{- define "mars.sections" -}}
{{- list "STATE" "MEMORY" "ROUTER" "DISPATCH" "JUDGE" "INGRESS" "GATEWAY" | toJson -}}
{{- end -}}

{{/* (list root deployable): the names of the global `env` a deployable is handed, as a YAML map. A service:
     every name but those in another deployable's section (MARS_ROUTER_ALPHA reaches the router alone). The
     gateway (a caller, GatewaySettings): names in its section; the caller's TLS and identity files
     (CallerSettings', the same names everywhere); and the service settings it has as its own, under its
     section (MARS_LOG_LEVEL is its MARS_GATEWAY_LOG_LEVEL; its metrics port is metrics.port); nothing else (Kafka, Postgres, ... are the
     services'). tests/chart/test_chart_settings.py checks these lists against the models. */}}
{{- define "mars.globalEnv" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $own := printf "MARS_%s_" (upper $name) -}}
{{- $others := list -}}
{{- range $section := include "mars.sections" $root | fromJsonArray }}
{{- if ne $section (upper $name) }}{{ $others = append $others (printf "MARS_%s_" $section) }}{{ end }}
{{- end }}
{{- $callerNames := list "MARS_TLS_CA_FILE" "MARS_TLS_CLIENT_CERT_FILE" "MARS_TLS_CLIENT_KEY_FILE" "MARS_IDENTITY_CERT_FILE" "MARS_IDENTITY_KEY_FILE" -}}
{{- /* Its metrics port is metrics.port, as the services' (MARS_GATEWAY_METRICS_PORT). */}}
{{- $gatewayShared := list "LOG_LEVEL" "UVLOOP" -}}
{{- range $k, $v := $root.Values.env }}
{{- $theirs := false }}
{{- range $prefix := $others }}{{ if hasPrefix $prefix $k }}{{ $theirs = true }}{{ end }}{{ end }}
{{- if eq $name "gateway" }}
{{- if or (hasPrefix $own $k) (has $k $callerNames) }}
{{ $k }}: {{ $v | quote }}
{{- else if has (trimPrefix "MARS_" $k) $gatewayShared }}
{{ printf "%s%s" $own (trimPrefix "MARS_" $k) }}: {{ $v | quote }}
{{- end }}
{{- else if not $theirs }}
{{ $k }}: {{ $v | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The model pool's file, mounted at /etc/mars/pool (MARS_ROUTER_MODEL_POOL, MARS_DISPATCH_MODEL_POOL and
     MARS_GATEWAY_MODEL_POOL point at it). */}}
{{- define "mars.modelPoolFile" -}}
/etc/mars/pool/models.yaml
{{- end -}}

{{/* (list root service): a service's settings, as a YAML map (its ConfigMap's data): the shared ones, the
     global `env` (mars.globalEnv), its own from the chart's values (under its section:
     MARS_STATE_QTM_BACKEND), then services.<name>.env. What needs a Secret or the pod's name is set on the
     container (MARS_REPLICA, the Kafka and Postgres logins). */}}
{{- define "mars.serviceEnv" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $svc := index $root.Values.services $name -}}
{{- $env := include "mars.sharedEnv" $root | fromYaml -}}
{{- range $k, $v := include "mars.globalEnv" (list $root $name) | fromYaml }}
{{- $_ := set $env $k (toString $v) }}
{{- end }}
{{- $_ := set $env "MARS_GRPC_PORT" (toString $svc.port) -}}
{{- if eq $name "state" }}
{{- $_ := set $env "MARS_STATE_QTM_BACKEND" $root.Values.state.qtmBackend }}
{{- if not (has $root.Values.state.qtmBackend (list "rules" "learned")) }}
{{- $_ := set $env "MARS_STATE_QTM_URL" ($root.Values.state.qtmUrl | default (ternary (include "mars.vllmUrl" $root) "" $root.Values.vllm.enabled) | required "state.qtmUrl is required when vllm.enabled is false and state.qtmBackend is openai") }}
{{- $_ := set $env "MARS_STATE_QTM_MODEL" ($root.Values.state.qtmModel | default $root.Values.vllm.servedModelName) }}
{{- end }}
{{- end }}
{{- if has $name (list "router" "dispatch") }}
{{- $_ := set $env (printf "MARS_%s_MODEL_POOL" (upper $name)) (include "mars.modelPoolFile" $root) }}
{{- end }}
{{- if and (eq $name "memory") $svc.gpu.enabled }}
{{- $_ := set $env "MARS_MEMORY_USE_GPU" "true" }}
{{- end }}
{{- if eq $name "ingress" }}
{{- /* A history import hands the context it leaves to the state service (StateEstimator.ImportContext), as
       the ingress identity, over the services' TLS. */}}
{{- $_ := set $env "MARS_INGRESS_STATE_ADDR" (printf "%s-state:%d" (include "mars.fullname" $root) (int $root.Values.services.state.port)) }}
{{- if $root.Values.identity.enabled }}
{{- $_ := set $env "MARS_IDENTITY_CERT_FILE" "/etc/mars/identity/tls.crt" }}
{{- $_ := set $env "MARS_IDENTITY_KEY_FILE" "/etc/mars/identity/tls.key" }}
{{- end }}
{{- if $root.Values.tls.enabled }}
{{- $_ := set $env "MARS_TLS_CA_FILE" "/etc/mars/tls/ca.crt" }}
{{- if $root.Values.tls.mutual }}
{{- /* tls.clientSecretName's certificate (client auth usage), as the gateway presents it. */}}
{{- $_ := set $env "MARS_TLS_CLIENT_CERT_FILE" "/etc/mars/tls-client/tls.crt" }}
{{- $_ := set $env "MARS_TLS_CLIENT_KEY_FILE" "/etc/mars/tls-client/tls.key" }}
{{- end }}
{{- end }}
{{- end }}
{{- range $k, $v := $svc.env }}
{{- $_ := set $env $k (toString $v) }}
{{- end }}
{{- range $k, $v := $env }}
{{ $k }}: {{ $v | quote }}
{{- end }}
{{- end -}}

{{/* The gateway's settings, as a YAML map (its ConfigMap's data): a caller of the ingress (GatewaySettings),
     its own settings under its section, the caller's TLS under the shared names; no service setting (Kafka,
     Postgres, identity CA, master key: it holds no secret). */}}
{{- define "mars.gatewayEnv" -}}
{{- $gw := .Values.gateway -}}
{{- $env := include "mars.globalEnv" (list . "gateway") | fromYaml | default (dict) -}}
{{- $_ := set $env "MARS_GATEWAY_HTTP_HOST" "0.0.0.0" -}}
{{- $_ := set $env "MARS_GATEWAY_HTTP_PORT" (toString $gw.port) -}}
{{- $_ := set $env "MARS_GATEWAY_INGRESS_ADDR" (printf "%s-ingress:%d" (include "mars.fullname" .) (int .Values.services.ingress.port)) -}}
{{- $_ := set $env "MARS_GATEWAY_MODEL_POOL" (include "mars.modelPoolFile" .) -}}
{{- $_ := set $env "MARS_GATEWAY_MAX_BODY_BYTES" (toString (int64 $gw.maxBodyBytes)) -}}
{{- $_ := set $env "MARS_GATEWAY_TURN_TIMEOUT_S" (toString $gw.turnTimeoutSeconds) -}}
{{- $_ := set $env "MARS_GATEWAY_METRICS_PORT" (toString .Values.metrics.port) -}}
{{- if .Values.tls.enabled }}
{{- /* The ingress serves TLS: trust its CA, and for mutual TLS present tls.clientSecretName's certificate. */}}
{{- $_ := set $env "MARS_TLS_CA_FILE" "/etc/mars/tls/ca.crt" }}
{{- if .Values.tls.mutual }}
{{- $_ := set $env "MARS_TLS_CLIENT_CERT_FILE" "/etc/mars/tls-client/tls.crt" }}
{{- $_ := set $env "MARS_TLS_CLIENT_KEY_FILE" "/etc/mars/tls-client/tls.key" }}
{{- end }}
{{- end }}
{{- range $k, $v := $gw.env }}
{{- $_ := set $env $k (toString $v) }}
{{- end }}
{{- range $k, $v := $env }}
{{ $k }}: {{ $v | quote }}
{{- end }}
{{- end -}}

{{/* (list root deployable): the deployable's ConfigMap, <fullname>-<deployable>-env: the settings it reads
     and no other's. */}}
{{- define "mars.envConfigMapName" -}}
{{- printf "%s-%s-env" (include "mars.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{- define "mars.envConfigMap" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "mars.envConfigMapName" . }}
  labels:
    {{- include "mars.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $name }}
data:
  {{- if eq $name "gateway" }}
  {{- include "mars.gatewayEnv" $root | nindent 2 }}
  {{- else }}
  {{- include "mars.serviceEnv" . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* The model pool's ConfigMap (router, dispatch and gateway mount it). */}}
{{- define "mars.modelPoolConfigMap" -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "mars.fullname" . }}-model-pool
  labels:
    {{- include "mars.labels" . | nindent 4 }}
data:
  models.yaml: |
    # The router's arms (one OpenAI-compatible endpoint each), from the chart's modelPool value.
    models:
    {{- if .Values.modelPool }}
    {{- toYaml .Values.modelPool | nindent 4 }}
    {{- else }}
    {{- include "mars.defaultPool" . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* (list root deployable): a checksum of what its pods read from ConfigMaps (its settings, the model pool),
     so a changed setting rolls its pods and no other deployable's. */}}
{{- define "mars.configChecksum" -}}
{{- print (include "mars.envConfigMap" .) (include "mars.modelPoolConfigMap" (index . 0)) | sha256sum -}}
{{- end -}}

{{/* Secret-backed environment (passwords) of every MARS container. */}}
{{- define "mars.secretEnv" -}}
{{- if and (include "mars.kafkaUsesSasl" .) (not (include "mars.kafkaPerService" .)) }}
- name: MARS_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "mars.kafkaPasswordSecret" . }}
      key: {{ .Values.kafka.sasl.passwordKey }}
{{- end }}
{{- if and (or .Values.postgres.password .Values.postgres.existingSecret) (not .Values.postgres.roles.enabled) }}
# libpq reads the password from PGPASSWORD: it never appears in the DSN or the ConfigMap.
- name: PGPASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "mars.postgresPasswordSecret" . }}
      key: {{ .Values.postgres.passwordKey }}
{{- end }}
{{- end -}}

{{/* (list root service): a service's envFrom: its own ConfigMap, and the provider API keys. */}}
{{- define "mars.envFrom" -}}
{{- $root := index . 0 -}}
- configMapRef:
    name: {{ include "mars.envConfigMapName" . }}
{{- if $root.Values.apiKeys }}
- secretRef:
    name: {{ include "mars.secretName" $root }}-api-keys
{{- end }}
{{- with $root.Values.apiKeysExistingSecret }}
- secretRef:
    name: {{ . }}
{{- end }}
{{- end -}}

{{/* Volumes every MARS pod mounts: a writable /tmp on a read-only root, the model pool, the Kafka CA; the
     services the master key besides. */}}
{{- define "mars.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
- name: pool
  configMap:
    name: {{ include "mars.fullname" . }}-model-pool
{{- if include "mars.kafkaUsesTls" . }}
- name: kafka-tls
  secret:
    secretName: {{ .Values.kafka.tls.caSecret }}
{{- end }}
{{- if .Values.postgres.caSecret }}
- name: postgres-tls
  secret:
    secretName: {{ .Values.postgres.caSecret }}
    items:
      - key: {{ .Values.postgres.caKey }}
        path: {{ .Values.postgres.caKey }}
{{- end }}
{{- /* The master key only where events are sealed or unsealed (the services): not in a tool pod (the hook
       Jobs, given the context merged with toolPod). */}}
{{- if and .Values.eventSealing.enabled (not .toolPod) }}
- name: master-key
  secret:
    secretName: {{ include "mars.masterKeySecret" . }}
    # Readable by the pod's group (fsGroup) alone, not by every user in the container (Kubernetes' 0644).
    defaultMode: 0440
    items:
      - key: {{ .Values.eventSealing.key }}
        path: {{ .Values.eventSealing.key }}
{{- if .Values.eventSealing.previousSecret }}
- name: master-key-previous
  secret:
    secretName: {{ .Values.eventSealing.previousSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.eventSealing.key }}
        path: {{ .Values.eventSealing.key }}
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "mars.tlsSecret" . }}
    # It holds the server's key: the pod's group alone, as the master key.
    defaultMode: 0440
{{- end }}
{{- if .Values.identity.enabled }}
- name: identity-ca
  secret:
    secretName: {{ include "mars.identityCaSecret" . }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end -}}

{{- define "mars.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: pool
  mountPath: /etc/mars/pool
  readOnly: true
{{- if include "mars.kafkaUsesTls" . }}
- name: kafka-tls
  mountPath: /etc/mars/kafka-tls
  readOnly: true
{{- end }}
{{- if .Values.postgres.caSecret }}
- name: postgres-tls
  mountPath: /etc/mars/postgres-tls
  readOnly: true
{{- end }}
{{- if and .Values.eventSealing.enabled (not .toolPod) }}
- name: master-key
  mountPath: /etc/mars/master-key
  readOnly: true
{{- if .Values.eventSealing.previousSecret }}
- name: master-key-previous
  mountPath: /etc/mars/master-key-previous
  readOnly: true
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/mars/tls
  readOnly: true
{{- end }}
{{- if .Values.identity.enabled }}
- name: identity-ca
  mountPath: /etc/mars/identity-ca
  readOnly: true
{{- end }}
{{- end -}}

{{/* The default model pool: one arm on the chart's vLLM server. */}}
{{- define "mars.defaultPool" -}}
- name: {{ .Values.vllm.servedModelName }}
  base_url: {{ include "mars.vllmUrl" . }}
  model: {{ .Values.vllm.servedModelName }}
  context_window: {{ .Values.vllm.maxModelLen }}
  output_reserve: 512
  safety_margin: 128
  input_price_per_m: 0.04
  output_price_per_m: 0.10
  timeout_s: 60
{{- end -}}

{{/* The container's preStop: serve on while the Service drops the terminating pod (values shutdown). */}}
{{- define "mars.lifecycle" -}}
{{- if gt (int .Values.shutdown.preStopSeconds) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .Values.shutdown.preStopSeconds | quote }}]
{{- end }}
{{- end -}}
