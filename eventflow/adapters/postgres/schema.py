"""The PostgreSQL schema of eventflow: tables, indexes, two functions, and the upgrade of
schemas made by earlier versions (``ef_dedup`` is in ``dedup.py``, ``ef_attempts`` in
``attempts.py``).

``ef_append_v4`` appends a batch to a stream: it checks the expected version, skips event
ids already stored and inserts the rest. ``ef_sequence_v3`` gives the next positions to the
events committed since its last pass, as runs in ``ef_runs`` (see ``docs/event-store.md`` for
why positions are assigned after commit, and how the sequencer knows it has missed nothing).
"""

from __future__ import annotations

from .upgrades import UPGRADES_SQL

__all__ = ["SCHEMA_SQL", "SEQUENCER_LOCK"]

SEQUENCER_LOCK = 1701147505  # the advisory lock key ef_sequence_v3() takes (keep in sync)

# Identifier columns use the "C" collation: byte-order comparisons keep their unique indexes
# cheap to maintain (a locale collation compares through strcoll), and ids need no locale.
SCHEMA_SQL = (
    """
CREATE TABLE IF NOT EXISTS ef_events (
    id bigserial PRIMARY KEY,
    event_id text COLLATE "C" NOT NULL UNIQUE,
    stream_id text COLLATE "C" NOT NULL,
    stream_version bigint NOT NULL,
    envelope bytea NOT NULL,
    correlation_id text COLLATE "C",
    UNIQUE (stream_id, stream_version)
);
-- Earlier versions also wrote each event's type into a `type` column that nothing reads:
-- appends no longer fill it (the type is in the envelope:
-- convert_from(envelope, 'UTF8')::jsonb ->> 'type'); and they had no correlation_id column.
-- Making the one nullable and adding the other locks ef_events for a moment, once; a
-- transaction that keeps the table open (a long report, say) would make every append queue
-- behind that lock, so it waits at most 2 s and then fails the open with what to do.
DO $$
DECLARE
    prev text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '2s', true);
    IF EXISTS (SELECT 1 FROM pg_attribute
                WHERE attrelid = 'ef_events'::regclass AND attname = 'type'
                  AND attnotnull AND NOT attisdropped) THEN
        ALTER TABLE ef_events ALTER COLUMN type DROP NOT NULL;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_attribute
                    WHERE attrelid = 'ef_events'::regclass AND attname = 'correlation_id'
                      AND NOT attisdropped) THEN
        ALTER TABLE ef_events ADD COLUMN correlation_id text COLLATE "C";
    END IF;
    PERFORM set_config('lock_timeout', prev, true);
EXCEPTION WHEN lock_not_available THEN
    RAISE EXCEPTION 'eventflow could not upgrade ef_events (make its old type column '
        'nullable, add correlation_id) within 2 s: another transaction holds the table'
        USING HINT = 'open the store again once long transactions on ef_events have ended '
                     '(see pg_stat_activity)';
END
$$;
-- `eventflow trace` finds a correlation's events through an index, not a scan. Appends fill
-- correlation_id from the envelope. Rows without it (stored by earlier versions, or appended
-- by one during an upgrade) are found by a partial index over the id inside their envelope;
-- the earlier full one (ef_events_correlation) read every appended envelope, which made an
-- append cost the server about twice as much. Building the partial index reads ef_events
-- once, on the first open by this version. ef_correlation_v1 is IMMUTABLE (convert_from is
-- only STABLE, for its encoding name: here always UTF8), so it can index.
CREATE OR REPLACE FUNCTION ef_correlation_v1(envelope bytea) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT convert_from(envelope, 'UTF8')::json ->> 'correlation_id' $$;
CREATE INDEX IF NOT EXISTS ef_events_correlation_id ON ef_events (correlation_id)
    WHERE correlation_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS ef_events_correlation_stored ON ef_events
    (ef_correlation_v1(envelope)) WHERE correlation_id IS NULL;
DROP INDEX IF EXISTS ef_events_correlation;
-- the global order, written by the sequencer and never updated: one row per run of events
-- with consecutive ids numbered together (ids id .. id + n - 1 have positions position ..
-- position + n - 1), so a pass writes a row or a few, not one per event
CREATE TABLE IF NOT EXISTS ef_runs (
    position bigint PRIMARY KEY,
    id bigint NOT NULL UNIQUE,
    n bigint NOT NULL CHECK (n > 0)
);
-- the sequencer's state (see ef_sequence_v3): the last position handed out, the ef_events
-- ids scanned so far, the ids below that it has not seen yet ("gaps") with their horizons
-- and the time it first missed them, and the transactions that may still commit a gap
-- kept in ef_gaps
CREATE TABLE IF NOT EXISTS ef_sequence (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    last bigint NOT NULL,
    scanned bigint NOT NULL DEFAULT 0,
    gaps bigint[] NOT NULL DEFAULT '{}',
    horizons xid8[] NOT NULL DEFAULT '{}',
    missed timestamptz[] NOT NULL DEFAULT '{}',
    watch xid8[] NOT NULL DEFAULT '{}'
);
INSERT INTO ef_sequence (singleton, last) VALUES (true, 0) ON CONFLICT DO NOTHING;
-- gaps missed for over a second, or beyond the newest thousand: looked up only when one of
-- the transactions in ef_sequence.watch has committed
CREATE TABLE IF NOT EXISTS ef_gaps (
    id bigint PRIMARY KEY,
    horizon xid8 NOT NULL
);
CREATE TABLE IF NOT EXISTS ef_snapshots (
    stream_id text PRIMARY KEY,
    version bigint NOT NULL,
    state jsonb NOT NULL,
    taken_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS ef_checkpoints (
    name text PRIMARY KEY,
    position bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS ef_outbox (
    seq bigserial PRIMARY KEY,
    topic text NOT NULL,
    msg_key text,
    payload bytea NOT NULL,
    message_id text NOT NULL
);
-- the store's leases (store.leases): one row per name, kept when released (expires_at in
-- the past) so that its epoch, the fencing token, only ever goes up
CREATE TABLE IF NOT EXISTS ef_leases (
    name text COLLATE "C" PRIMARY KEY,
    owner text NOT NULL,
    epoch bigint NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS ef_dead_letters (
    seq bigserial PRIMARY KEY,
    id text NOT NULL UNIQUE,
    topic text NOT NULL,
    grp text NOT NULL,
    payload bytea NOT NULL,
    error text NOT NULL,
    reason text NOT NULL,
    attempts integer NOT NULL,
    failed_at timestamptz NOT NULL,
    msg_key text,
    headers jsonb NOT NULL,
    envelope_id text,
    source jsonb NOT NULL
);
CREATE TABLE IF NOT EXISTS ef_heartbeats (
    instance text PRIMARY KEY,
    app text NOT NULL,
    host text NOT NULL,
    pid integer NOT NULL,
    started_at timestamptz NOT NULL,
    last_seen timestamptz NOT NULL,
    subscriptions jsonb NOT NULL,
    stats jsonb NOT NULL
);
ALTER TABLE ef_heartbeats
    ADD COLUMN IF NOT EXISTS health text NOT NULL DEFAULT 'ok',
    ADD COLUMN IF NOT EXISTS problems jsonb NOT NULL DEFAULT '[]';

-- (ef_append_v2, of earlier versions, took the types too: schemas they made keep it for
-- them; it writes the `type` column, which only such schemas have.)
CREATE OR REPLACE FUNCTION ef_append_v4(
    p_stream text, p_expected bigint, p_ids text[], p_envelopes bytea[], p_correlations text[]
) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    cur bigint;
    fresh int[];
BEGIN
    PERFORM pg_current_xact_id();  -- a transaction id before any event id (see below)
    SELECT COALESCE(MAX(stream_version), 0) INTO cur FROM ef_events WHERE stream_id = p_stream;
    SELECT array_agg(i ORDER BY i) INTO fresh
      FROM generate_subscripts(p_ids, 1) AS i
     WHERE NOT EXISTS (SELECT 1 FROM ef_events e WHERE e.event_id = p_ids[i]);
    IF fresh IS NULL THEN
        IF cardinality(p_ids) > 0 OR p_expected IS NULL OR p_expected = cur THEN
            RETURN cur;  -- nothing new: a retried append, or an empty batch
        END IF;
    END IF;
    IF p_expected IS NOT NULL AND p_expected <> cur THEN
        RAISE EXCEPTION USING ERRCODE = 'EF409', MESSAGE = cur::text;
    END IF;
    IF fresh IS NULL THEN
        RETURN cur;
    END IF;
    INSERT INTO ef_events (event_id, stream_id, stream_version, envelope, correlation_id)
    SELECT p_ids[i], p_stream, cur + ord, p_envelopes[i], p_correlations[i]
      FROM unnest(fresh) WITH ORDINALITY AS f(i, ord)
     ORDER BY ord;
    RETURN cur + cardinality(fresh);
END
$$;
-- Processes of the version before, during an upgrade: their rows go without correlation_id.
CREATE OR REPLACE FUNCTION ef_append_v3(
    p_stream text, p_expected bigint, p_ids text[], p_envelopes bytea[]
) RETURNS bigint LANGUAGE sql AS $$ SELECT ef_append_v4($1, $2, $3, $4, NULL) $$;

-- Number the events committed since the last pass, in id order. Every writer takes its
-- transaction id before it draws an event id; the sequencer reads the highest id drawn
-- (`top`), then takes its own transaction id (`own`), then the snapshot of its scan. So an
-- id <= top that the scan cannot see belongs to a writer that rolled back or is still
-- running, with a transaction id below `own` (the id's horizon). Such ids are kept as gaps
-- until they are visible (numbered then, with the rest of the pass, in id order) or a
-- snapshot's xmin reaches their horizon: nothing below it runs any more, so the writer
-- rolled back (dropped). A snapshot's xmax is no horizon: a running transaction may be
-- above it.
--
-- Young gaps are looked up on every pass. A gap missed for over a second, or beyond the
-- newest thousand, moves to ef_gaps, with every transaction then running below its horizon
-- added to `watch`: its writer, if it can still commit, is one of them. ef_gaps is looked
-- up only in a pass whose snapshot sees a watched transaction committed, so every gap that
-- has become visible is numbered in that pass, in id order with the rest; a watched
-- transaction leaves `watch` once that pass has looked (or it rolled back). When none is
-- left, what ef_gaps still holds was rolled back. So a long transaction (which keeps xmin
-- from any horizon) costs nothing per pass while it runs.
--
-- Positions are written as runs: the events of a pass are numbered in id order, so each
-- stretch of consecutive ids gets consecutive positions and is stored as one ef_runs row.
DROP FUNCTION IF EXISTS ef_sequence_v2(integer, boolean);
CREATE OR REPLACE FUNCTION ef_sequence_v3(p_batch integer) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    s record;
    top bigint;
    hi bigint;
    n bigint;
    own xid8;
    young_gaps bigint[];
    young_horizons xid8[];
    young_missed timestamptz[];
    new_watch xid8[];
BEGIN
    SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END INTO top
      FROM ef_events_id_seq;
    SELECT * INTO s FROM ef_sequence;
    IF top <= s.scanned AND cardinality(s.gaps) = 0
       AND NOT EXISTS (SELECT 1 FROM unnest(s.watch) AS w (x)
                        WHERE pg_xact_status(w.x) IS DISTINCT FROM 'in progress') THEN
        RETURN 0;  -- nothing to look at: no lock, no transaction id, no write
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'ef_sequence_v3() needs a READ COMMITTED transaction'
            USING HINT = 'call it outside any REPEATABLE READ or SERIALIZABLE transaction';
    END IF;
    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION 'ef_sequence_v3() must start its own transaction'
            USING HINT = 'call it alone, in autocommit mode, not after other writes';
    END IF;
    -- One sequencer at a time (waits for the current one).
    PERFORM pg_advisory_xact_lock(1701147505);
    SELECT * INTO s FROM ef_sequence;
    SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END INTO top
      FROM ef_events_id_seq;
    own := pg_current_xact_id();  -- after `top`, before the snapshot of the scan
    hi := GREATEST(s.scanned, LEAST(top, s.scanned + p_batch));
    WITH snap AS MATERIALIZED (
        SELECT pg_current_snapshot() AS sn  -- the snapshot of this whole statement
    ), woke AS MATERIALIZED (
        -- watched transactions this snapshot sees committed: ef_gaps is looked up
        SELECT w.x FROM unnest(s.watch) AS w (x), snap
         WHERE pg_visible_in_snapshot(w.x, snap.sn)
    ), seen AS MATERIALIZED (
        SELECT e.id FROM ef_events e WHERE e.id > s.scanned AND e.id <= hi
        UNION ALL
        SELECT e.id FROM ef_events e WHERE e.id = ANY (s.gaps)
        UNION ALL
        SELECT g.id FROM ef_gaps g JOIN ef_events e ON e.id = g.id
         WHERE EXISTS (SELECT 1 FROM woke)
    ), numbered AS (
        SELECT id, row_number() OVER (ORDER BY id) AS rn FROM seen
    ), runs AS (
        -- consecutive ids have the same id - rn: one row per stretch
        INSERT INTO ef_runs (position, id, n)
        SELECT s.last + min(rn), min(id), count(*) FROM numbered GROUP BY id - rn
    ), missing AS (
        -- Not seen, and the writer may still run. A horizon above `own` comes from
        -- another cluster (a restored dump): nothing there can still run.
        SELECT g.id, g.horizon, g.missed,
               g.missed < now() - interval '1 second'
               OR row_number() OVER (ORDER BY g.id DESC) > 1000 AS old
          FROM (SELECT i AS id, own AS horizon, now() AS missed
                  FROM generate_series(s.scanned + 1, hi) AS i
                UNION ALL
                SELECT * FROM unnest(s.gaps, s.horizons, s.missed)) AS g (id, horizon, missed),
               snap
         WHERE NOT EXISTS (SELECT 1 FROM seen WHERE seen.id = g.id)
           AND pg_snapshot_xmin(snap.sn) < g.horizon AND g.horizon <= own
    ), aged AS (
        INSERT INTO ef_gaps (id, horizon)
        SELECT id, horizon FROM missing WHERE old
    ), watching AS (
        -- Kept: watched transactions not seen committed here and not rolled back (one that
        -- commits during this statement is seen by the next pass). Added, when gaps age
        -- here: every transaction running at this snapshot below their newest horizon
        -- (those in its xip list, and every one from its xmax up to `own`).
        SELECT w.x FROM unnest(s.watch) AS w (x)
         WHERE w.x NOT IN (SELECT x FROM woke)
           AND pg_xact_status(w.x) IN ('in progress', 'committed')
        UNION
        SELECT r.x
          FROM (SELECT pg_snapshot_xip(snap.sn) AS x FROM snap
                UNION ALL
                SELECT (i::text)::xid8
                  FROM snap, generate_series(pg_snapshot_xmax(snap.sn)::text::bigint,
                                             own::text::bigint - 1) AS i) AS r
         WHERE r.x < (SELECT max(horizon) FROM missing WHERE old)
    ), settled AS (
        DELETE FROM ef_gaps g USING snap
         WHERE g.id IN (SELECT id FROM seen)
            OR pg_snapshot_xmin(snap.sn) >= g.horizon
            OR g.horizon > own
            OR NOT EXISTS (SELECT 1 FROM watching)  -- no writer left: rolled back
    )
    SELECT (SELECT count(*) FROM numbered),
           (SELECT array_agg(id ORDER BY id) FROM missing WHERE NOT old),
           (SELECT array_agg(horizon ORDER BY id) FROM missing WHERE NOT old),
           (SELECT array_agg(missed ORDER BY id) FROM missing WHERE NOT old),
           (SELECT array_agg(x) FROM watching)
      INTO n, young_gaps, young_horizons, young_missed, new_watch;
    UPDATE ef_sequence
       SET last = s.last + n, scanned = hi,
           gaps = COALESCE(young_gaps, '{}'), horizons = COALESCE(young_horizons, '{}'),
           missed = COALESCE(young_missed, '{}'), watch = COALESCE(new_watch, '{}');
    IF n > 0 THEN
        PERFORM pg_notify('ef_sequenced', (s.last + n)::text);
    END IF;
    RETURN CASE WHEN hi < top THEN GREATEST(n, p_batch) ELSE n END;  -- >= p_batch: call again
END
$$;

-- The sequencer reads the highest id handed out from the id sequence: with a per-backend
-- cache, a backend could still draw an id below it afterwards.
DO $$
BEGIN
    IF (SELECT seqcache FROM pg_sequence
         WHERE seqrelid = 'ef_events_id_seq'::regclass) <> 1 THEN
        RAISE EXCEPTION 'the sequence ef_events_id_seq has a CACHE above 1: the sequencer '
            'could miss events'
            USING HINT = 'run ALTER SEQUENCE ef_events_id_seq CACHE 1';
    END IF;
END
$$;
"""
    + UPGRADES_SQL
)
