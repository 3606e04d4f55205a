"""MARS tooling: the `mars` command line, benchmarks, evaluation, probes, replay, deployment and training.

Tooling imports the runtime (`mars`, the services, the local launcher `mars_stack`); nothing in the runtime
imports tooling (`make lint` checks the contract in `.importlinter`)."""
