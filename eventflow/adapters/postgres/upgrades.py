"""The upgrade of PostgreSQL schemas made by earlier eventflow versions to the sequencer of
this one (run at the end of ``SCHEMA_SQL``, after the tables and functions exist), and the
traps that make processes of those versions fail loudly instead of writing where nothing
reads any more."""

from __future__ import annotations

__all__ = ["UPGRADES_SQL"]

UPGRADES_SQL = """
-- Upgrade from the queue-based sequencer of earlier versions (an ef_unsequenced table that
-- every append wrote to): number what the queue holds, start scanning after the newest
-- event, and replace the queue and the old functions. The table lock waits for the old
-- appends and sequencer passes under way, and keeps new ones out (every old append and
-- pass touches the queue first), so no old code runs while this block does.
DO $$
DECLARE
    base bigint;
    n bigint;
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = to_regclass('ef_unsequenced'))
       IS DISTINCT FROM 'r' THEN
        RETURN;  -- no queue (a new schema), or already replaced by the view below
    END IF;
    LOCK TABLE ef_unsequenced IN ACCESS EXCLUSIVE MODE;
    ALTER TABLE ef_sequence
        ADD COLUMN IF NOT EXISTS scanned bigint NOT NULL DEFAULT 0,
        ADD COLUMN IF NOT EXISTS gaps bigint[] NOT NULL DEFAULT '{}',
        ADD COLUMN IF NOT EXISTS horizons xid8[] NOT NULL DEFAULT '{}',
        ADD COLUMN IF NOT EXISTS missed timestamptz[] NOT NULL DEFAULT '{}',
        ADD COLUMN IF NOT EXISTS watch xid8[] NOT NULL DEFAULT '{}';
    SELECT last INTO base FROM ef_sequence;
    WITH taken AS (DELETE FROM ef_unsequenced RETURNING id)
    INSERT INTO ef_positions (position, id)
    SELECT base + row_number() OVER (ORDER BY id), id FROM taken;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE ef_sequence
       SET last = base + n, scanned = (SELECT COALESCE(MAX(id), 0) FROM ef_events);
    DROP TABLE ef_unsequenced;
    DROP FUNCTION IF EXISTS ef_sequence(integer);
    DROP FUNCTION IF EXISTS ef_append(text, bigint, text[], text[], bytea[]);
END
$$;

-- Upgrade from one row per position (an ef_positions table, written by ef_sequence_v2 of
-- earlier versions) to runs: each stretch of consecutive positions with consecutive ids
-- becomes one ef_runs row. The table lock waits for the old passes and reads under way and
-- keeps new ones out, then the table is replaced by the trap below.
DO $$
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = to_regclass('ef_positions'))
       IS DISTINCT FROM 'r' THEN
        RETURN;  -- a new schema, or already upgraded
    END IF;
    LOCK TABLE ef_positions IN ACCESS EXCLUSIVE MODE;
    INSERT INTO ef_runs (position, id, n)
    SELECT min(position), min(id), count(*)
      FROM (SELECT position, id,
                   sum(CASE WHEN id = prev + 1 THEN 0 ELSE 1 END)
                       OVER (ORDER BY position) AS run
              FROM (SELECT position, id, lag(id) OVER (ORDER BY position) AS prev
                      FROM ef_positions) AS p) AS r
     GROUP BY run;
    DROP TABLE ef_positions;
END
$$;

-- A trap for earlier versions that numbered events into ef_positions: their schema setup
-- skips the existing name, and their sequencer passes and reads fail on it (with the hint
-- below), instead of numbering events that this version's readers would never see.
CREATE OR REPLACE FUNCTION ef_positions_moved() RETURNS TABLE ("position" bigint, id bigint)
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'eventflow: positions moved from ef_positions to ef_runs; this process '
        'runs an earlier eventflow version'
        USING HINT = 'stop it and upgrade it to the version that opened this schema';
END
$$;
CREATE OR REPLACE FUNCTION ef_positions_moved_write() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM ef_positions_moved();
    RETURN NULL;
END
$$;
DO $$
BEGIN
    IF to_regclass('ef_positions') IS NULL THEN
        CREATE VIEW ef_positions AS SELECT * FROM ef_positions_moved();
        COMMENT ON VIEW ef_positions IS
            'eventflow: an earlier version tried to read or number positions here';
    END IF;
    IF (SELECT relkind FROM pg_class WHERE oid = to_regclass('ef_positions')) = 'v'
       AND NOT EXISTS (SELECT 1 FROM pg_trigger
                        WHERE tgrelid = to_regclass('ef_positions')
                          AND tgname = 'ef_positions_moved') THEN
        CREATE TRIGGER ef_positions_moved INSTEAD OF INSERT ON ef_positions
            FOR EACH ROW EXECUTE FUNCTION ef_positions_moved_write();
    END IF;
END
$$;
-- Processes of that version started before the upgrade call their sequencer by name: this
-- stand-in tells them why it fails (one started later replaces it with its own, which then
-- fails on the view above with the same message).
CREATE OR REPLACE FUNCTION ef_sequence_v2(p_batch integer) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM ef_positions_moved();
    RETURN 0;
END
$$;

-- A trap for earlier versions: their schema setup skips an existing ef_unsequenced, and
-- their appends then fail on it (a view nothing can be inserted into), instead of writing
-- events that only their own sequencer would number.
DO $$
BEGIN
    IF to_regclass('ef_unsequenced') IS NULL THEN
        CREATE VIEW ef_unsequenced AS SELECT NULL::bigint AS id WHERE false;
        COMMENT ON VIEW ef_unsequenced IS
            'eventflow: an earlier version tried to append here; stop it and upgrade it';
    END IF;
END
$$;
"""
