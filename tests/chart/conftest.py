"""The chart tests validate hundreds of rendered objects against Kubernetes' schemas; kubernetes_validate
reads and parses the schema files (its `_definitions.json` is megabytes) on every call. The files do not
change during a run, and jsonschema never mutates a schema, so each is read once: same verdicts, about 10x
faster."""

from __future__ import annotations

import functools

import kubernetes_validate.utils

kubernetes_validate.utils.schema_contents = functools.cache(
    kubernetes_validate.utils.schema_contents
)
