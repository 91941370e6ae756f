"""The file queue: its one state machine, leases, the circuit breaker and policies."""
