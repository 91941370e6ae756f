"""The PostgreSQL queue (docs/architecture.md, "The PostgreSQL queue"): one database holds the
tasks, records, events and blobs of many runner hosts. Imported only when a queue URL is used, so
`fila --help` and `fila submit` on the file queue never load psycopg."""
