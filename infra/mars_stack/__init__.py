"""Local stack launcher for MARS (embedded broker, Postgres, LLM server and the services)."""

from mars_stack.stack import SERVICES, LocalStack, StackError, StackSettings

__all__ = ["SERVICES", "LocalStack", "StackError", "StackSettings"]
