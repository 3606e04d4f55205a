"""The OpenAI-compatible HTTP gateway in front of the gRPC ingress."""
