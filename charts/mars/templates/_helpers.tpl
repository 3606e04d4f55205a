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

{{/* Settings every service reads (the <fullname>-env ConfigMap; hook Jobs inline the same map). */}}
{{- define "mars.commonEnv" -}}
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
{{- range $k, $v := .Values.env }}
{{ $k }}: {{ $v | quote }}
{{- end }}
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

{{- define "mars.envFrom" -}}
- configMapRef:
    name: {{ include "mars.fullname" . }}-env
{{- if .Values.apiKeys }}
- secretRef:
    name: {{ include "mars.secretName" . }}-api-keys
{{- end }}
{{- with .Values.apiKeysExistingSecret }}
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
