"""Running jobs: the cycle of one task (job) and the worker loop that claims tasks."""
