-- fila's PostgreSQL queue, version 1 (docs/architecture.md, "The PostgreSQL queue").
-- Applied by fila.queue.pg.migrate in one transaction, with its row in fila_schema.

-- Fencing tokens: every change of a task's owner (claim, requeue, a sweep's decision, a retry)
-- draws a new one, so the holder of an older token can change nothing.
CREATE SEQUENCE fila_token_seq;

CREATE TABLE fila_tasks (
    id               text PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9._-]{1,128}$' AND id NOT IN ('.', '..')),
    state            text NOT NULL CHECK (state IN ('queued', 'running', 'needs_review', 'failed',
                                                   'needs_human', 'applied', 'rejected')),
    task             jsonb NOT NULL,
    engine           text NOT NULL,
    attempt          integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    tries            integer NOT NULL DEFAULT 0 CHECK (tries >= 0),       -- attempts lost before start
    max_tries        integer NOT NULL DEFAULT 5 CHECK (max_tries >= 1),   -- the retry budget
    runner           text,
    token            bigint,
    lease_expires_at timestamptz,
    started          boolean NOT NULL DEFAULT false,                     -- the container started
    not_before       timestamptz,
    submitted_at     timestamptz NOT NULL DEFAULT now(),
    claimed_at       timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CHECK (state <> 'running' OR (runner IS NOT NULL AND token IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CHECK (state <> 'queued' OR (runner IS NULL AND NOT started))
);
CREATE INDEX fila_tasks_claimable ON fila_tasks (engine, submitted_at, id) WHERE state = 'queued';
CREATE INDEX fila_tasks_leases ON fila_tasks (lease_expires_at) WHERE state = 'running';
CREATE INDEX fila_tasks_state ON fila_tasks (state, submitted_at);

-- The review record: the same JSON as fila/out/<id>.json.
CREATE TABLE fila_records (
    id         text PRIMARY KEY REFERENCES fila_tasks (id) ON DELETE CASCADE,
    record     jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Every event of a task, appended (fila/logs/<id>.events.jsonl); never changed.
CREATE TABLE fila_events (
    seq     bigserial PRIMARY KEY,
    task_id text NOT NULL REFERENCES fila_tasks (id) ON DELETE CASCADE,
    at      timestamptz NOT NULL DEFAULT now(),
    event   text NOT NULL,
    data    jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX fila_events_task ON fila_events (task_id, seq);

CREATE FUNCTION fila_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'fila_events is append-only';
END $$;
CREATE TRIGGER fila_events_append_only BEFORE UPDATE ON fila_events
    FOR EACH ROW EXECUTE FUNCTION fila_events_append_only();

-- Content-addressed blobs (DIFF.patch, the log, the manifest...): the database checks the hash
-- too, so no client can store bytes under another content's name.
CREATE TABLE fila_blobs (
    sha256     text PRIMARY KEY CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    size       bigint NOT NULL,
    data       bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT fila_blobs_hash CHECK (sha256 = encode(sha256(data), 'hex') AND size = octet_length(data))
);

-- Which blobs a task's publish named (name: "DIFF.patch", "log", "manifest", ...).
CREATE TABLE fila_task_blobs (
    task_id text NOT NULL REFERENCES fila_tasks (id) ON DELETE CASCADE,
    name    text NOT NULL CHECK (name ~ '^[A-Za-z0-9._-]{1,128}$'),
    sha256  text NOT NULL REFERENCES fila_blobs (sha256),
    attempt integer NOT NULL,
    PRIMARY KEY (task_id, name)
);
