"""The host at a glance: `fila doctor` and `fila status`."""
