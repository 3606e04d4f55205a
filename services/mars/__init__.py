"""MARS shared core: contracts (generated in mars.v1), domain logic, config, Kafka and telemetry plumbing."""
