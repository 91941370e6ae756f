-- fila's PostgreSQL queue, version 5 (docs/scale-out.md, "The circuit breaker across hosts").
-- Applied by fila.queue.pg.migrate in one transaction, with its row in fila_schema.

-- One circuit breaker per queue database, shared by every runner: the same state as the file
-- queue's fila/state/breaker.json (queue/breaker.py). A publish counts its outcome here in its own
-- transaction (queue/pg/breaker.py); while `open`, the claim statement claims nothing, so a
-- runner that never looks at the breaker cannot claim either. `fila rearm --queue URL` closes it.
CREATE TABLE fila_breaker (
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),
    open        boolean NOT NULL DEFAULT false,
    consecutive integer NOT NULL DEFAULT 0 CHECK (consecutive >= 0),
    threshold   integer NOT NULL DEFAULT 5 CHECK (threshold > 0),
    recent      text[] NOT NULL DEFAULT '{}',
    tripped_at  timestamptz,
    tripped_by  text,
    reason      text,
    rearmed_at  timestamptz,
    rearmed_by  text,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
INSERT INTO fila_breaker DEFAULT VALUES;

-- Its trips and rearms (fila/state/breaker.events.jsonl on the file queue): appended to, never
-- rewritten, like fila_events (version 4).
CREATE TABLE fila_breaker_events (
    seq   bigserial PRIMARY KEY,
    at    timestamptz NOT NULL DEFAULT now(),
    event text NOT NULL,
    data  jsonb NOT NULL DEFAULT '{}'
);
CREATE FUNCTION fila_breaker_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'fila_breaker_events is append-only';
END $$;
CREATE TRIGGER fila_breaker_events_append_only BEFORE UPDATE OR DELETE ON fila_breaker_events
    FOR EACH ROW EXECUTE FUNCTION fila_breaker_events_append_only();
CREATE TRIGGER fila_breaker_events_no_truncate BEFORE TRUNCATE ON fila_breaker_events
    FOR EACH STATEMENT EXECUTE FUNCTION fila_breaker_events_append_only();
