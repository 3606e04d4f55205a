"""Small schemas of our own for the CRD kinds the chart renders (Kubernetes' schemas have none of them).

They check the fields the chart sets, after the CRDs' published shapes (Strimzi KafkaTopic and KafkaUser v1beta2, KEDA
ScaledObject / TriggerAuthentication v1alpha1, prometheus-operator ServiceMonitor v1). Any other kind
without a Kubernetes schema is a test failure.
"""

from __future__ import annotations

from typing import Any

_STR = {"type": "string", "minLength": 1}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def _kind(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


KAFKA_TOPIC = _kind(
    "kafka.strimzi.io/v1beta2",
    "KafkaTopic",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["partitions", "replicas"],
        "properties": {
            "topicName": {"type": "string", "pattern": r"^[A-Za-z0-9._-]{1,249}$"},
            "partitions": {"type": "integer", "minimum": 1},
            "replicas": {"type": "integer", "minimum": 1, "maximum": 32767},
            "config": {"type": "object"},
        },
    },
)

_ACL_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["resource", "operations"],
    "properties": {
        "resource": {
            "type": "object",
            "additionalProperties": False,
            "required": ["type"],
            "properties": {
                "type": {"enum": ["topic", "group", "cluster", "transactionalId"]},
                "name": _STR,
                "patternType": {"enum": ["literal", "prefix"]},
            },
        },
        "operations": {
            "type": "array",
            "minItems": 1,
            "items": {
                "enum": [
                    "Read",
                    "Write",
                    "Create",
                    "Delete",
                    "Alter",
                    "Describe",
                    "ClusterAction",
                    "AlterConfigs",
                    "DescribeConfigs",
                    "IdempotentWrite",
                    "All",
                ]
            },
        },
        "host": {"type": "string"},
        "type": {"enum": ["allow", "deny"]},
    },
}

KAFKA_USER = _kind(
    "kafka.strimzi.io/v1beta2",
    "KafkaUser",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["authentication", "authorization"],
        "properties": {
            "authentication": {
                "type": "object",
                "additionalProperties": False,
                "required": ["type"],
                "properties": {"type": {"enum": ["scram-sha-512", "tls", "tls-external"]}},
            },
            "authorization": {
                "type": "object",
                "additionalProperties": False,
                "required": ["type", "acls"],
                "properties": {"type": {"const": "simple"}, "acls": {"type": "array", "items": _ACL_RULE}},
            },
        },
    },
)

_KAFKA_TRIGGER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type", "metadata"],
    "properties": {
        "type": {"const": "kafka"},
        "name": _STR,
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["bootstrapServers", "consumerGroup", "lagThreshold"],
            "properties": {
                "bootstrapServers": _STR,
                "consumerGroup": _STR,
                "topic": _STR,
                "lagThreshold": {"type": "string", "pattern": "^[0-9]+$"},
                "activationLagThreshold": {"type": "string", "pattern": "^[0-9]+$"},
                "offsetResetPolicy": {"enum": ["earliest", "latest"]},
                "allowIdleConsumers": {"enum": ["true", "false"]},
            },
        },
        "authenticationRef": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": _STR,
                "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
            },
        },
    },
}

SCALED_OBJECT = _kind(
    "keda.sh/v1alpha1",
    "ScaledObject",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["scaleTargetRef", "triggers"],
        "properties": {
            "scaleTargetRef": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {"name": _STR, "kind": _STR, "apiVersion": _STR},
            },
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "triggers": {"type": "array", "minItems": 1, "items": _KAFKA_TRIGGER},
        },
    },
)

TRIGGER_AUTHENTICATION = _kind(
    "keda.sh/v1alpha1",
    "TriggerAuthentication",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["secretTargetRef"],
        "properties": {
            "secretTargetRef": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["parameter", "name", "key"],
                    "properties": {
                        "parameter": {"enum": ["sasl", "username", "password", "tls", "ca", "cert", "key"]},
                        "name": _STR,
                        "key": _STR,
                    },
                },
            }
        },
    },
)

SERVICE_MONITOR = _kind(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["selector", "endpoints"],
        "properties": {
            "selector": {"type": "object"},
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["port"],
                    "properties": {
                        "port": _STR,
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    },
                },
            },
        },
    },
)

#: (apiVersion, kind) -> schema: the allow-list of CRD kinds.
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("kafka.strimzi.io/v1beta2", "KafkaTopic"): KAFKA_TOPIC,
    ("kafka.strimzi.io/v1beta2", "KafkaUser"): KAFKA_USER,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    ("keda.sh/v1alpha1", "TriggerAuthentication"): TRIGGER_AUTHENTICATION,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
}
