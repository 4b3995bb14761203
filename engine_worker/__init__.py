"""The engine worker process: owns the model and pushes generation events over ZeroMQ."""
