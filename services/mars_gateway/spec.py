"""The HTTP gateway's spec (mars.spec): a deployable with settings of its own and no stage."""

from __future__ import annotations

from mars.spec import GatewaySpec

from mars_gateway.settings import GatewaySettings

SPEC = GatewaySpec("gateway", GatewaySettings)
