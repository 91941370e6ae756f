-- fila's PostgreSQL queue, version 3 (docs/architecture.md, "The PostgreSQL queue").
-- Applied by fila.queue.pg.migrate in one transaction, with its row in fila_schema.

-- The runners the queue knows: each `fila worker --queue` writes its row when it starts and on
-- its heartbeat, with the database's clock (never the runner's), and marks it stopped when it
-- stops. `fila status --queue` reads them: which engines a live runner can take.
CREATE TABLE fila_runners (
    id         text PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 200),
    engines    text[] NOT NULL,
    images     jsonb NOT NULL DEFAULT '{}'::jsonb,
    slots      integer NOT NULL CHECK (slots > 0),
    started_at timestamptz NOT NULL DEFAULT now(),
    seen_at    timestamptz NOT NULL DEFAULT now(),
    stopped_at timestamptz
);
