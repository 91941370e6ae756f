-- fila's PostgreSQL queue, version 2 (docs/architecture.md, "The PostgreSQL queue").
-- Applied by fila.queue.pg.migrate in one transaction, with its row in fila_schema.

-- A record is stored under its own task's id only: no write can put one task's record in
-- another task's row.
ALTER TABLE fila_records ADD CONSTRAINT fila_records_own_id CHECK (record->>'id' = id);

-- The random value one claim() call stores with what it claimed: a claim whose commit reply was
-- lost finds its own task again by it instead of claiming a second one.
ALTER TABLE fila_tasks ADD COLUMN claim_nonce text;
