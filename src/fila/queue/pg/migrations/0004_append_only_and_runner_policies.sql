-- fila's PostgreSQL queue, version 4 (docs/architecture.md, "The PostgreSQL queue").
-- Applied by fila.queue.pg.migrate in one transaction, with its row in fila_schema.

-- fila_events is the queue's history: appended to, never rewritten. Version 1 refused UPDATE
-- only; a DELETE or a TRUNCATE could still erase what happened. Now all three are refused (a task
-- row's DELETE, which would cascade to its events, is refused with them). fila itself never
-- deletes an event; an owner who must (a purge) drops these triggers in a transaction of their own.
DROP TRIGGER fila_events_append_only ON fila_events;
CREATE TRIGGER fila_events_append_only BEFORE UPDATE OR DELETE ON fila_events
    FOR EACH ROW EXECUTE FUNCTION fila_events_append_only();
CREATE TRIGGER fila_events_no_truncate BEFORE TRUNCATE ON fila_events
    FOR EACH STATEMENT EXECUTE FUNCTION fila_events_append_only();

-- The policies a runner takes (`fila worker --queue URL --policy NAME`, repeatable); NULL: any
-- policy its root holds. `fila status --queue` names the queued tasks no live runner takes.
ALTER TABLE fila_runners ADD COLUMN policies text[];
