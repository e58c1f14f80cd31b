"""The PostgreSQL schema of eventflow: tables, indexes and two functions.

``ef_append`` appends a batch to a stream: it checks the expected version, skips event ids
already stored, inserts the rest and queues their ids in ``ef_unsequenced``.
``ef_sequence`` gives the next positions to committed queued events, in ``ef_positions``
(see ``docs/event-store.md`` for why positions are assigned after commit).
"""

from __future__ import annotations

__all__ = ["SCHEMA_SQL", "SEQUENCER_LOCK"]

SEQUENCER_LOCK = 1701147505  # the advisory lock key ef_sequence() takes (keep in sync)

# Identifier columns use the "C" collation: byte-order comparisons keep their unique indexes
# cheap to maintain (a locale collation compares through strcoll), and ids need no locale.
SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS ef_events (
    id bigserial PRIMARY KEY,
    event_id text COLLATE "C" NOT NULL UNIQUE,
    stream_id text COLLATE "C" NOT NULL,
    stream_version bigint NOT NULL,
    type text NOT NULL,
    envelope bytea NOT NULL,
    UNIQUE (stream_id, stream_version)
);
-- ids of committed-or-not events still waiting for a position (written by appends)
CREATE TABLE IF NOT EXISTS ef_unsequenced (
    id bigint PRIMARY KEY
);
-- the global order: narrow rows written by the sequencer, never updated
CREATE TABLE IF NOT EXISTS ef_positions (
    position bigint PRIMARY KEY,
    id bigint NOT NULL UNIQUE
);
CREATE TABLE IF NOT EXISTS ef_sequence (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    last bigint NOT NULL
);
INSERT INTO ef_sequence (singleton, last) VALUES (true, 0) ON CONFLICT DO NOTHING;
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
CREATE TABLE IF NOT EXISTS ef_dedup (
    grp text COLLATE "C" NOT NULL,
    message_id text COLLATE "C" NOT NULL,
    handled_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (grp, message_id)
);
CREATE INDEX IF NOT EXISTS ef_dedup_age ON ef_dedup (handled_at);
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

CREATE OR REPLACE FUNCTION ef_append(
    p_stream text, p_expected bigint, p_ids text[], p_types text[], p_envelopes bytea[]
) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    cur bigint;
    fresh int[];
BEGIN
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
    WITH ins AS (
        INSERT INTO ef_events (event_id, stream_id, stream_version, type, envelope)
        SELECT p_ids[i], p_stream, cur + ord, p_types[i], p_envelopes[i]
          FROM unnest(fresh) WITH ORDINALITY AS f(i, ord)
         ORDER BY ord
        RETURNING id
    )
    INSERT INTO ef_unsequenced (id) SELECT id FROM ins;
    RETURN cur + cardinality(fresh);
END
$$;

CREATE OR REPLACE FUNCTION ef_sequence(p_batch integer) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    base bigint;
    n bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM ef_unsequenced) THEN
        RETURN 0;
    END IF;
    -- One sequencer at a time (waits for the current one): positions are handed out in
    -- one place, to committed events only, in insertion (id) order.
    PERFORM pg_advisory_xact_lock(1701147505);
    SELECT last INTO base FROM ef_sequence;
    WITH taken AS (
        DELETE FROM ef_unsequenced
         WHERE id IN (SELECT id FROM ef_unsequenced ORDER BY id LIMIT p_batch)
        RETURNING id
    )
    INSERT INTO ef_positions (position, id)
    SELECT base + row_number() OVER (ORDER BY id), id FROM taken;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        UPDATE ef_sequence SET last = base + n;
        PERFORM pg_notify('ef_sequenced', (base + n)::text);
    END IF;
    RETURN n;
END
$$;
"""
