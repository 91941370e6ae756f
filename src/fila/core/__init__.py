"""The bottom layer: the error tree, statuses, file formats, the queue root's layout and the
primitives every other package uses (atomic writes, stored files, untrusted JSON, crash points).
It imports nothing else of fila."""
