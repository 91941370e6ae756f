"""`network: allowlist` from the host's side: policy to gateway config, the gateway's log to
the record."""
