"""The rootless Podman backend: the job's container and its egress gateway."""
