"""A job's files: the job directory and snapshots prepared from the project, the walk of
engine-written trees, and DIFF.patch computed from them."""
