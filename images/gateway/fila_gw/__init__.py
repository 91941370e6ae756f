"""fila's egress gateway, the parts of the addon (fila_gateway.py, next to this package, is the
addon mitmdump loads and states the container's contract). The modules that do not import mitmproxy
(config, policy, jsonvalues, meter, scrub, record) are tested on their own in fila's test suite
(tests/test_gateway_parts.py)."""
