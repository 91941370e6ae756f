"""The runners table of a PostgreSQL queue (docs/scale-out.md, "Running it"): each runner's row
says what it takes (engines and their images, policies, slots) and when it was last seen, on the
database's clock. This is the runners' side, which writes it (PgQueue is one); `fila status
--queue` reads it through db.py's `runners`."""

from __future__ import annotations

from collections.abc import Iterable

from .db import Database


class PgRunners(Database):
    """A queue database's runners table, as each runner writes its own row."""

    def runner_up(
        self,
        runner: str,
        engines: Iterable[str],
        *,
        images: dict[str, str],
        slots: int,
        policies: Iterable[str] | None = None,
    ) -> None:
        """A runner starts: its row written (again) with what it can take (`policies` None: any
        policy); seen now."""
        from psycopg.types.json import Jsonb

        pols = sorted(set(policies)) if policies is not None else None
        self._tx(
            lambda conn, _again: conn.execute(
                "INSERT INTO fila_runners (id, engines, images, slots, policies) VALUES (%s, %s, %s, %s, %s) "
                "ON CONFLICT (id) DO UPDATE SET engines = EXCLUDED.engines, images = EXCLUDED.images, "
                "slots = EXCLUDED.slots, policies = EXCLUDED.policies, started_at = now(), "
                "seen_at = now(), stopped_at = NULL",
                (runner, sorted(set(engines)), Jsonb(images), slots, pols),
            )
        )

    def runner_takes(
        self, runner: str, engines: Iterable[str], *, images: dict[str, str], policies: Iterable[str] | None
    ) -> None:
        """A running runner left an engine or a policy out: its row says what it still takes (its
        start, slots and heartbeat unchanged)."""
        from psycopg.types.json import Jsonb

        pols = sorted(set(policies)) if policies is not None else None
        self._tx(
            lambda conn, _again: conn.execute(
                "UPDATE fila_runners SET engines = %s, images = %s, policies = %s WHERE id = %s",
                (sorted(set(engines)), Jsonb(images), pols, runner),
            )
        )

    def runner_beat(self, runner: str) -> None:
        """The runner's heartbeat: seen now (the database's clock)."""
        self._tx(
            lambda conn, _again: conn.execute(
                "UPDATE fila_runners SET seen_at = now(), stopped_at = NULL WHERE id = %s", (runner,)
            )
        )

    def runner_down(self, runner: str) -> None:
        """The runner stops: it takes nothing more (its row stays, for `fila status`)."""
        self._tx(
            lambda conn, _again: conn.execute(
                "UPDATE fila_runners SET seen_at = now(), stopped_at = now() WHERE id = %s", (runner,)
            )
        )
