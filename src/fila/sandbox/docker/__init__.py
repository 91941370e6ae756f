"""The Docker backend: the job's container, its egress gateway and its images."""
