"""Local stack launcher for MARS (embedded broker, Postgres, LLM server and the services)."""

import os

# The launcher forks (Postgres as its own user needs a real fork, not vfork) from threads of processes that
# also talk gRPC (readiness checks, the harnesses). gRPC's fork handlers then crashed the child before
# exec now and then (Postgres restarts dying with SIGSEGV, no log line): the launcher needs none of them.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from mars_stack.broker import stack_broker_kind, stack_kafka_options
from mars_stack.readiness import StackError
from mars_stack.stack import LocalStack
from mars_stack.stack_settings import StackSettings

__all__ = ["LocalStack", "StackError", "StackSettings", "stack_broker_kind", "stack_kafka_options"]
