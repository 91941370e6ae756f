-- fila's PostgreSQL queue, version 6 (docs/provenance.md, "Keys").
-- Applied by fila.queue.pg.migrate in one transaction, with its row in fila_schema.

-- The public keys whose signatures on a task's statements are trusted (`fila keys init --queue`,
-- `fila keys trust --queue`): the file queue's fila/keys/trusted.json. Each runner host signs the
-- run statements of the tasks it ran with its own key, and a reviewer the decisions with theirs;
-- `fila verify` and `fila apply` accept a statement only when its key is here. The key itself is
-- securesystemslib's JSON form; fila computes its keyid again when it reads a row.
CREATE TABLE fila_trusted_keys (
    keyid      text PRIMARY KEY CHECK (keyid ~ '^[0-9a-f]{64}$'),
    name       text NOT NULL,
    key        jsonb NOT NULL,
    added_at   timestamptz NOT NULL DEFAULT now(),
    added_by   text NOT NULL
);
