-- pg_multiregion 0.1.0 → 0.2.0: sequences are one counter for the cluster
-- (docs/ARCHITECTURE.md §8.3). Run by ALTER EXTENSION pg_multiregion UPDATE; the result
-- equals a fresh install of 0.2.0 (regress test extension_update checks it).
\echo Use "ALTER EXTENSION pg_multiregion UPDATE" to load this file. \quit

-- The name under which each sequence's cluster-wide counter is kept in the meta group: its
-- name when the last schema change that created or renamed it committed (sequences.rs). A
-- sequence renamed by a transaction still draws under its old name until that commits.
CREATE TABLE multiregion.sequence_keys (
    seq oid PRIMARY KEY,
    nspname name NOT NULL,
    relname name NOT NULL
);
INSERT INTO multiregion.sequence_keys
SELECT c.oid, n.nspname, c.relname
  FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
 WHERE c.relkind = 'S' AND c.relpersistence = 'p'
   AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'multiregion', 'multiregion_keys')
   AND n.nspname NOT LIKE 'pg\_%';
GRANT SELECT ON multiregion.sequence_keys TO PUBLIC;

-- PostgreSQL's sequence functions, drawing from the cluster-wide counters; the planner hook
-- points calls of pg_catalog's at these.
CREATE FUNCTION multiregion."nextval"("seq" regclass) RETURNS bigint
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'mr_nextval_wrapper';

CREATE FUNCTION multiregion."currval"("seq" regclass) RETURNS bigint
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'mr_currval_wrapper';

CREATE FUNCTION multiregion."lastval"() RETURNS bigint
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'mr_lastval_wrapper';

CREATE FUNCTION multiregion."setval"("seq" regclass, "value" bigint) RETURNS bigint
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'mr_setval_wrapper';

CREATE FUNCTION multiregion."setval"("seq" regclass, "value" bigint, "is_called" bool)
RETURNS bigint
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c AS 'MODULE_PATHNAME', 'mr_setval3_wrapper';

-- SHOW DATABASES and the SHOW forms naming another database: each database's survival goal
-- and placement, cluster-wide.
CREATE FUNCTION multiregion."database_goals"() RETURNS TABLE (
	"database_name" TEXT,
	"survival_goal" TEXT,
	"placement" TEXT
)
STRICT STABLE
LANGUAGE c AS 'MODULE_PATHNAME', 'database_goals_wrapper';

-- CockroachDB's unique_rowid(): cluster-unique 64-bit IDs (10 µs ticks and the node's ID).
CREATE FUNCTION multiregion."unique_rowid"() RETURNS bigint
PARALLEL SAFE
STRICT VOLATILE
LANGUAGE c AS 'MODULE_PATHNAME', 'unique_rowid_wrapper';

-- Every node's progress through every database's schema log, with a change a node's applier
-- reported it cannot apply (issue 14 item 6).
CREATE FUNCTION multiregion."schema_appliers_info"() RETURNS TABLE (
	"database_name" TEXT,
	"node_id" bigint,
	"applied_version" bigint,
	"latest_version" bigint,
	"failed_version" bigint,
	"error" TEXT
)
STRICT
LANGUAGE c AS 'MODULE_PATHNAME', 'schema_appliers_info_wrapper';
CREATE VIEW multiregion.schema_appliers AS
    SELECT * FROM multiregion.schema_appliers_info() ORDER BY database_name, node_id;

-- Whether this node's copy of a REGIONAL BY ROW partition holds a key (conflict_region's
-- first look, in the row's own region; routing.rs).
CREATE FUNCTION multiregion."key_in_local_partition"("table" oid, "region" TEXT, "key" jsonb)
RETURNS bool STRICT LANGUAGE c AS 'MODULE_PATHNAME', 'key_in_local_partition_wrapper';

-- Has the running statement's next row of a REGIONAL BY ROW table written after the
-- statement ('write_after') or left out ('skip'): conflict_region's way of moving a row
-- before an upsert writes it, or of leaving a conflicting row alone (moved.rs).
CREATE FUNCTION multiregion."upsert_next_row"("table" oid, "how" TEXT)
RETURNS bool STRICT LANGUAGE c AS 'MODULE_PATHNAME', 'upsert_next_row_wrapper';

-- INSERT … ON CONFLICT (key) on a REGIONAL BY ROW table, by a key without the region column
-- (CockroachDB's UPSERT, and its ON CONFLICT over an implicitly partitioned key): the region
-- of the row that already holds the key, in whichever partition it lives, else the region the
-- new row would get. rewrite.rs puts this call in the region column, so the row is written
-- into — and its conflict decided in — the partition that has the key, and updated there.
-- Where the statement decides the row's region itself (p_decided 'given' or 'computed') and
-- the key lives in another region, p_action says what CockroachDB does: 'nothing' leaves the
-- row out; 'move' (a DO UPDATE that assigns the region, a column it is computed from, or
-- rehomes) first moves the existing row by an UPDATE of p_placed's columns to the proposed
-- values, then has the proposed row written after the statement, when that row is there to
-- conflict with (moved.rs); 'update' updates the row where it is — which a computed region
-- cannot do: its CHECK ties the proposed row to its own values.
CREATE FUNCTION multiregion.conflict_region(p_table regclass, p_key jsonb, p_proposed text,
                                            p_decided text, p_action text, p_placed jsonb)
RETURNS text LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_column name;
    v_region text;
    v_match text;
    v_found text;
    v_key_table regclass;
    v_held boolean;
    v_set text;
BEGIN
    SELECT l.region_column INTO v_column FROM multiregion.table_locality l
     WHERE l.relid = p_table AND l.locality = 'regional_by_row';
    -- Keys with a NULL part are never equal to another (SQL's rule): no conflict to find.
    IF v_column IS NULL OR p_key IS NULL
       OR EXISTS (SELECT 1 FROM jsonb_each(p_key) e WHERE e.value = 'null') THEN
        RETURN p_proposed;
    END IF;
    SELECT string_agg(format('t.%I = k.%I', e.key, e.key), ' AND ') INTO v_match
      FROM jsonb_each(p_key) e;
    -- The proposed region first, as CockroachDB's locality-optimized search does: usually
    -- this node's, whose partition it leases, so an update of a row of its own region reads
    -- nothing elsewhere (this node's copy, exact where it is the leaseholder).
    IF p_proposed IS NOT NULL
       AND multiregion.key_in_local_partition(p_table, p_proposed, p_key) THEN
        RETURN p_proposed;
    END IF;
    -- Then the key table that keeps the key unique across regions, if there is one: a new
    -- key — the other common case — is absent from it, and one range answers for every
    -- region. (A key unique by construction has none; then every other region is read.)
    SELECT g.key_table INTO v_key_table FROM multiregion.global_key g
     WHERE g.relid = p_table
       AND (SELECT array_agg(c::text ORDER BY c) FROM unnest(g.columns) c)
           = (SELECT array_agg(k ORDER BY k) FROM jsonb_object_keys(p_key) k);
    IF v_key_table IS NOT NULL THEN
        EXECUTE format('SELECT true FROM %s t, jsonb_populate_record(NULL::%s, $1) k WHERE %s',
                       v_key_table, v_key_table, v_match)
           INTO v_held USING p_key;
        IF v_held IS NULL THEN
            RETURN p_proposed;
        END IF;
    END IF;
    -- Then each other region's partition, one statement each: a statement that reads one
    -- partition runs where that partition can be read (this node's replica, or its
    -- leaseholder); one over several leaseholders could not run on a node without a replica
    -- of each. The region leads each partition's index, which finds the key.
    FOR v_region IN
        SELECT r FROM multiregion.database_config c, unnest(c.regions) r
         WHERE r IS DISTINCT FROM p_proposed ORDER BY r
    LOOP
        EXECUTE format('SELECT t.%I::text FROM %s t, jsonb_populate_record(NULL::%s, $1) k '
                       'WHERE t.%I = %L AND %s LIMIT 1',
                       v_column, p_table, p_table, v_column, v_region, v_match)
           INTO v_found USING p_key;
        EXIT WHEN v_found IS NOT NULL;
    END LOOP;
    IF v_found IS NULL OR p_proposed IS NULL OR p_proposed = v_found THEN
        RETURN coalesce(v_found, p_proposed);
    END IF;
    IF p_action = 'move' THEN
        SELECT string_agg(format('%I = (jsonb_populate_record(NULL::%s, $1)).%I',
                                 e.key, p_table, e.key), ', ')
          INTO v_set FROM jsonb_each(p_placed) e;
        EXECUTE format('UPDATE %s t SET %s FROM jsonb_populate_record(NULL::%s, $2) k '
                       'WHERE t.%I = %L AND %s',
                       p_table, v_set, p_table, v_column, v_found, v_match)
           USING p_placed, p_key;
        IF NOT multiregion.upsert_next_row(p_table, 'write_after') THEN
            RAISE EXCEPTION 'cannot move the row with key % of table % from region "%" to "%" in this statement',
                    p_key, p_table, v_found, p_proposed
                USING ERRCODE = 'feature_not_supported',
                      HINT = 'Move the row with UPDATE first, or upsert it in a statement of its own.';
        END IF;
        RETURN p_proposed;
    END IF;
    IF p_decided = 'default' THEN
        RETURN v_found;
    END IF;
    IF p_action = 'nothing' AND multiregion.upsert_next_row(p_table, 'skip') THEN
        RETURN p_proposed;
    END IF;
    IF p_decided = 'given' THEN
        -- Updated (or left) where it is, as CockroachDB does: the proposed row's region
        -- only decides where a new row goes.
        RETURN v_found;
    END IF;
    RAISE EXCEPTION 'cannot update the row with key % of table % in region "%" by INSERT … ON CONFLICT: its region is computed, and the proposed row''s is "%"',
            p_key, p_table, v_found, p_proposed
        USING ERRCODE = 'feature_not_supported',
              HINT = 'Assign the columns the region is computed from in DO UPDATE SET (the row then moves), or update the row with UPDATE.';
END
$fn$;

-- A schema change that checks rows, run here for the node where it was typed, which holds no
-- replica of some of the table's ranges this node leases (fence.rs, `validate_elsewhere`):
-- run as the caller, with the origin's search path, and rolled back whatever it does. Its
-- error, if it fails here, fails the change there before it commits. (The statement is not
-- top level here: nothing of it is replicated or fenced again.)
CREATE FUNCTION multiregion.validate_ddl(p_sql text, p_search_path text)
RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    BEGIN
        PERFORM pg_catalog.set_config('search_path', p_search_path, true);
        EXECUTE p_sql;
        RAISE EXCEPTION 'rolled back' USING ERRCODE = 'MR000';
    EXCEPTION WHEN SQLSTATE 'MR000' THEN
        NULL;
    END;
END
$fn$;

-- TRUNCATE of one partition of a REGIONAL BY ROW table (fence.rs): each of its rows' keys
-- unique across regions is released, as its DELETE would release it — at the key table's
-- leaseholder after the statement with row replication on, here otherwise (a key of this
-- partition is held by no other). Does nothing for any other relation.
CREATE FUNCTION multiregion.release_partition_keys(p_partition regclass) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_parent regclass;
    v_key_table regclass;
    v_constraint text;
    v_cols name[];
    v_pairs text;
    v_match text;
    v_key jsonb;
BEGIN
    SELECT i.inhparent INTO v_parent FROM pg_catalog.pg_inherits i
      JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
     WHERE i.inhrelid = p_partition AND c.relispartition;
    IF v_parent IS NULL THEN
        RETURN;
    END IF;
    FOR v_key_table, v_constraint, v_cols IN
        SELECT g.key_table, g.constraint_name, g.columns FROM multiregion.global_key g
         WHERE g.relid = v_parent
    LOOP
        SELECT string_agg(format('%L, t.%I', c, c), ', '),
               string_agg(format('t.%I IS NOT NULL', c), ' AND ')
          INTO v_pairs, v_match FROM unnest(v_cols) c;
        FOR v_key IN EXECUTE format('SELECT jsonb_build_object(%s) FROM %s t WHERE %s',
                                    v_pairs, p_partition, v_match)
        LOOP
            IF NOT multiregion.record_key_change(v_key_table, v_parent, v_constraint, v_key, NULL) THEN
                EXECUTE format('DELETE FROM %s k WHERE (%s) = (SELECT %s FROM jsonb_populate_record(NULL::%s, $1) r)',
                               v_key_table,
                               (SELECT string_agg(format('k.%I', c), ', ') FROM unnest(v_cols) c),
                               (SELECT string_agg(format('r.%I', c), ', ') FROM unnest(v_cols) c),
                               v_key_table)
                    USING v_key;
            END IF;
        END LOOP;
    END LOOP;
END
$fn$;

-- A dropped table takes its locality, its global keys and their key tables with it (on every
-- node: the DROP is replicated, and each node's trigger cleans up its own catalog); so does a
-- dropped unique index or constraint its global key, key table and triggers. A key table
-- still referenced by another table's foreign key makes the DROP fail, as the referenced
-- table (or key) itself would.
CREATE OR REPLACE FUNCTION multiregion.forget_dropped() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_key_table regclass;
    v_relid oid;
    v_constraint name;
BEGIN
    FOR v_key_table IN
        SELECT g.key_table FROM multiregion.global_key g
          JOIN pg_catalog.pg_event_trigger_dropped_objects() d
            ON d.classid = 'pg_catalog.pg_class'::regclass AND d.objid = g.relid AND d.objsubid = 0
    LOOP
        EXECUTE format('DROP TABLE IF EXISTS %s', v_key_table);
    END LOOP;
    DELETE FROM multiregion.global_key g USING pg_catalog.pg_event_trigger_dropped_objects() d
     WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.objid = g.relid AND d.objsubid = 0;
    DELETE FROM multiregion.table_locality l USING pg_catalog.pg_event_trigger_dropped_objects() d
     WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.objid = l.relid AND d.objsubid = 0;
    -- An index of a table that stays: its global key, if it kept one (the index and the
    -- constraint share the key's name; the table's schema is the index's).
    FOR v_key_table, v_relid, v_constraint IN
        SELECT g.key_table, g.relid, g.constraint_name FROM multiregion.global_key g
          JOIN pg_catalog.pg_class c ON c.oid = g.relid
          JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
          JOIN pg_catalog.pg_event_trigger_dropped_objects() d
            ON d.object_type = 'index' AND d.schema_name = n.nspname
           AND d.object_identity = pg_catalog.format('%I.%I', n.nspname, g.constraint_name)
    LOOP
        EXECUTE format('DROP TRIGGER IF EXISTS %I ON %s', 'mr_global_key_' || v_constraint,
                       v_relid::regclass);
        EXECUTE format('DROP TRIGGER IF EXISTS %I ON %s',
                       'mr_global_key_truncate_' || v_constraint, v_relid::regclass);
        EXECUTE format('DROP TABLE IF EXISTS %s', v_key_table);
        DELETE FROM multiregion.global_key g
         WHERE g.relid = v_relid AND g.constraint_name = v_constraint;
    END LOOP;
END
$fn$;

-- pgmr, once this node no longer holds a replica of a range whose table keeps its layout
-- (the replica moved to another node): the copy's rows go, with the applier's cursor. Reads
-- go to the replicas, but a schema change's checks and rewrites on this node would meet the
-- copy's rows as they were when it left (rows deleted or moved since, keys repeated: an
-- applier refusing a change the replicas accept). Removed as the applier removes rows
-- (nothing captured; a key table keeps its own range's rows). A partition that is no longer
-- one, or a table that is now partitioned, is left alone: its layout changed.
CREATE FUNCTION multiregion.drop_range_copy(p_range bigint, p_schema text, p_table text,
                                            p_partition text)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass := pg_catalog.to_regclass(format('%I.%I', p_schema, p_table));
BEGIN
    DELETE FROM multiregion.range_state WHERE range_id = p_range;
    IF v_rel IS NULL THEN
        RETURN;
    END IF;
    IF p_partition IS NULL THEN
        IF EXISTS (SELECT FROM pg_catalog.pg_inherits WHERE inhparent = v_rel) THEN
            RETURN;
        END IF;
    ELSE
        v_rel := multiregion.range_leaf(p_schema, p_table, p_partition);
        IF v_rel IS NULL THEN
            RETURN;
        END IF;
    END IF;
    PERFORM pg_catalog.set_config('session_replication_role', 'replica', true);
    EXECUTE format('DELETE FROM %s', v_rel);
    PERFORM pg_catalog.set_config('session_replication_role', 'origin', true);
END
$fn$;
REVOKE EXECUTE ON FUNCTION multiregion.drop_range_copy(bigint, text, text, text) FROM PUBLIC;

-- pg_dump and pg_restore of a multi-region database (docs/ARCHITECTURE.md §2.1.1).
-- What pg_dump carries of this catalog (docs/ARCHITECTURE.md §2.1.1). The tables above key
-- by OID, which a restore changes, and a restore must not meet them before the objects they
-- describe exist everywhere; this table holds the same declarations keyed by regclass, which
-- dumps as a qualified name and restores as the new OID, and pg_extension_config_dump puts
-- its rows in every dump. Triggers keep this database's own rows equal to the catalog; rows
-- from another database (a restore: `origin` differs) wait for multiregion.post_restore().
CREATE TABLE multiregion.dump_catalog (
    origin text NOT NULL,
    kind text NOT NULL CHECK (kind IN ('database', 'table', 'global_key')),
    rel regclass,
    key_table regclass,
    entry jsonb NOT NULL
);
SELECT pg_catalog.pg_extension_config_dump('multiregion.dump_catalog', '');
GRANT SELECT ON multiregion.dump_catalog TO PUBLIC;

-- Which database wrote a dump_catalog row: this server's system identifier and the
-- database's OID, so a dump restored on any server, or into another database of the same
-- one, is told apart from the database's own rows.
CREATE FUNCTION multiregion.dump_origin() RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
    SELECT s.system_identifier::text || '/' || d.oid::text
      FROM pg_catalog.pg_control_system() s, pg_catalog.pg_database d
     WHERE d.datname = pg_catalog.current_database();
$fn$;

CREATE FUNCTION multiregion.refresh_dump_catalog() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_origin text := multiregion.dump_origin();
BEGIN
    DELETE FROM multiregion.dump_catalog WHERE origin = v_origin;
    INSERT INTO multiregion.dump_catalog (origin, kind, entry)
    SELECT v_origin, 'database', jsonb_build_object('primary_region', primary_region,
               'regions', to_jsonb(regions), 'survival_goal', survival_goal,
               'placement', placement, 'secondary_region', secondary_region)
      FROM multiregion.database_config WHERE primary_region IS NOT NULL;
    INSERT INTO multiregion.dump_catalog (origin, kind, rel, entry)
    SELECT v_origin, 'table', l.relid::regclass, to_jsonb(l) - 'relid' - 'region_expr'
      FROM multiregion.table_locality l JOIN pg_catalog.pg_class c ON c.oid = l.relid;
    INSERT INTO multiregion.dump_catalog (origin, kind, rel, key_table, entry)
    SELECT v_origin, 'global_key', g.relid::regclass, g.key_table,
           jsonb_build_object('constraint_name', g.constraint_name, 'columns', to_jsonb(g.columns))
      FROM multiregion.global_key g JOIN pg_catalog.pg_class c ON c.oid = g.relid
      JOIN pg_catalog.pg_class k ON k.oid = g.key_table;
    RETURN NULL;
END
$fn$;
-- ENABLE ALWAYS: the catalog is also written in replica mode (a schema change applied by pgmr).
CREATE TRIGGER refresh_dump_catalog
    AFTER UPDATE OF primary_region, regions, survival_goal, placement, secondary_region
    ON multiregion.database_config
    FOR EACH STATEMENT EXECUTE FUNCTION multiregion.refresh_dump_catalog();
CREATE TRIGGER refresh_dump_catalog AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
    ON multiregion.table_locality
    FOR EACH STATEMENT EXECUTE FUNCTION multiregion.refresh_dump_catalog();
CREATE TRIGGER refresh_dump_catalog AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
    ON multiregion.global_key
    FOR EACH STATEMENT EXECUTE FUNCTION multiregion.refresh_dump_catalog();
ALTER TABLE multiregion.database_config ENABLE ALWAYS TRIGGER refresh_dump_catalog;
ALTER TABLE multiregion.table_locality ENABLE ALWAYS TRIGGER refresh_dump_catalog;
ALTER TABLE multiregion.global_key ENABLE ALWAYS TRIGGER refresh_dump_catalog;
-- The declarations a database already has, for its next dump.
UPDATE multiregion.database_config SET primary_region = primary_region;

-- multiregion.post_restore(): adopts a restored dump's declarations in one schema change.
CREATE  FUNCTION multiregion."post_restore"(
	"declarations" jsonb DEFAULT NULL /* Option < pgrx :: JsonB > */
) RETURNS TEXT /* String */

LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'post_restore_wrapper';

-- multiregion.gather_rows(table, columns, filter): a replicated table's rows read through its
-- leaseholders, for a read no node holds every range of (PLACEMENT RESTRICTED) re-planned over
-- them (gather.rs); only the columns the read needs, only rows passing its filter.
CREATE FUNCTION multiregion."gather_rows"(
	"table" oid,
	"columns" int2[] DEFAULT NULL,
	"filter" pg_node_tree DEFAULT NULL
) RETURNS text
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'gather_rows_wrapper';

-- multiregion.gather_partials(table, groups, aggregates, filter): each leaseholder's
-- aggregates over its partitions, grouped, for a gathered aggregate combined here
-- (partial_agg.rs).
CREATE FUNCTION multiregion."gather_partials"(
	"table" oid,
	"groups" int2[],
	"aggregates" pg_node_tree,
	"filter" pg_node_tree DEFAULT NULL
) RETURNS text
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'gather_partials_wrapper';

-- Replicated entries are applied by statements each backend prepares once per relation
-- (multiregion.apply_changes, apply.rs), and one-range commits proposed together are one
-- batch entry (multiregion.apply_range_batch); apply_range_txn is rebuilt on the same parts.
CREATE FUNCTION multiregion."apply_changes"("p_changes" text) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
LANGUAGE c
AS 'MODULE_PATHNAME', 'apply_changes_wrapper';
REVOKE EXECUTE ON FUNCTION multiregion.apply_changes(text) FROM PUBLIC;

-- One transaction's rows, applied by an applier that holds its range's cursor (below): the
-- transaction id is inserted first, and the rows applied only if it was new (an entry the
-- leaseholder's own transaction committed, or one applied before, is passed over). Returns
-- whether it applied them. A transaction over several ranges (p_keep false) has one key for
-- all of its entries: an applier that applied one removes the key again, so the next
-- range's entry applies too.
CREATE FUNCTION multiregion.apply_txn_rows(p_range bigint, p_index bigint, p_txn text,
                                           p_changes text, p_schema_version bigint,
                                           p_keep boolean)
RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_set_role boolean;
BEGIN
    IF multiregion.schema_version() < p_schema_version THEN
        RAISE EXCEPTION 'entry % of range % needs schema version %; this node has %',
            p_index, p_range, p_schema_version, multiregion.schema_version()
            USING ERRCODE = '55000';
    END IF;
    INSERT INTO multiregion.range_txns (txn_id) VALUES (p_txn) ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    -- pgmr's applier sets the role for its session: changing it empties the backend's
    -- plan cache (PostgreSQL's rule), which would make every statement plan again.
    v_set_role := pg_catalog.current_setting('session_replication_role') <> 'replica';
    IF v_set_role THEN
        PERFORM pg_catalog.set_config('session_replication_role', 'replica', true);
    END IF;
    -- In order; consecutive inserts into one relation together, by statements each
    -- backend prepares once per relation (apply.rs).
    PERFORM multiregion.apply_changes(p_changes);
    IF v_set_role THEN
        PERFORM pg_catalog.set_config('session_replication_role', 'origin', true);
    END IF;
    IF NOT p_keep THEN
        -- A prepared entry: the same transaction's entries of other ranges use the key too.
        DELETE FROM multiregion.range_txns WHERE txn_id = p_txn;
    END IF;
    RETURN true;
END
$fn$;

-- Locks range p_range's applier cursor and says whether entry p_index is still to apply:
-- false when the cursor is past it, or when an installed snapshot already holds its rows
-- (then the cursor moves to it here). The cursor row is locked first: a snapshot being
-- installed moves it too.
CREATE FUNCTION multiregion.begin_range_entry(p_range bigint, p_index bigint)
RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_at bigint;
    v_skip bigint[];
BEGIN
    SELECT applied_index, skip INTO v_at, v_skip FROM multiregion.range_state
     WHERE range_id = p_range FOR UPDATE;
    IF v_at >= p_index THEN
        RETURN false;
    END IF;
    IF p_index = ANY (v_skip) THEN
        UPDATE multiregion.range_state SET applied_index = p_index,
               skip = pg_catalog.array_remove(skip, p_index)
         WHERE range_id = p_range;
        RETURN false;
    END IF;
    RETURN true;
END
$fn$;

-- Moves range p_range's applier cursor to p_index, adding p_skip's later entries to pass over.
CREATE FUNCTION multiregion.end_range_entry(p_range bigint, p_index bigint, p_skip bigint[])
RETURNS void LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $fn$
    INSERT INTO multiregion.range_state (range_id, applied_index, skip)
        VALUES (p_range, p_index, p_skip)
        ON CONFLICT (range_id) DO UPDATE SET applied_index = excluded.applied_index,
            skip = multiregion.range_state.skip || excluded.skip;
$fn$;

-- pgmr's range applier: applies entry p_index of range p_range once, in the caller's
-- transaction with the cursor. The insert of the transaction's id waits for a local
-- transaction holding it, then skips the entry (it committed) or applies it (it aborted). A
-- transaction split over several entries of one range is applied whole at the first; p_skip
-- names the others, which the applier then passes over.
CREATE OR REPLACE FUNCTION multiregion.apply_range_txn(p_range bigint, p_index bigint, p_txn text,
                                            p_changes jsonb, p_schema_version bigint,
                                            p_keep boolean DEFAULT true,
                                            p_skip bigint[] DEFAULT '{}')
RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_new boolean := false;
BEGIN
    IF NOT multiregion.begin_range_entry(p_range, p_index) THEN
        RETURN false;
    END IF;
    v_new := multiregion.apply_txn_rows(p_range, p_index, p_txn, p_changes::text,
                                        p_schema_version, p_keep);
    PERFORM multiregion.end_range_entry(p_range, p_index, p_skip);
    RETURN v_new;
END
$fn$;

-- pgmr's range applier: a batch entry (several one-range transactions committed together,
-- each as apply_range_txn would apply it), all in the caller's transaction with the cursor.
CREATE FUNCTION multiregion.apply_range_batch(p_range bigint, p_index bigint, p_txns text[],
                                              p_changes text[], p_schema_versions bigint[])
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
    IF NOT multiregion.begin_range_entry(p_range, p_index) THEN
        RETURN;
    END IF;
    FOR i IN 1 .. coalesce(pg_catalog.array_length(p_txns, 1), 0) LOOP
        PERFORM multiregion.apply_txn_rows(p_range, p_index, p_txns[i], p_changes[i],
                                           p_schema_versions[i], true);
    END LOOP;
    PERFORM multiregion.end_range_entry(p_range, p_index, '{}');
END
$fn$;
REVOKE EXECUTE ON FUNCTION multiregion.apply_range_batch(bigint, bigint, text[], text[], bigint[]),
    multiregion.apply_txn_rows(bigint, bigint, text, text, bigint, boolean),
    multiregion.begin_range_entry(bigint, bigint),
    multiregion.end_range_entry(bigint, bigint, bigint[]) FROM PUBLIC;

-- Installing a snapshot into a partition locks its parents first, in DDL's order.
CREATE FUNCTION multiregion.lock_partition_parents(p_rel regclass)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_parent regclass;
BEGIN
    FOR v_parent IN
        SELECT a.relid FROM pg_catalog.pg_partition_ancestors(p_rel) WITH ORDINALITY a(relid, n)
         WHERE a.relid <> p_rel ORDER BY a.n DESC
    LOOP
        EXECUTE format('LOCK TABLE ONLY %s IN ACCESS SHARE MODE', v_parent);
    END LOOP;
END
$fn$;
REVOKE EXECUTE ON FUNCTION multiregion.lock_partition_parents(regclass) FROM PUBLIC;
CREATE OR REPLACE FUNCTION multiregion.begin_range_install(p_range bigint, p_schema text, p_table text,
    p_partition text, p_index bigint, p_schema_version bigint, p_skip bigint[])
RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass;
    v_at bigint;
BEGIN
    IF multiregion.schema_version() < p_schema_version THEN
        RAISE EXCEPTION 'the snapshot of range % needs schema version %; this node has %',
            p_range, p_schema_version, multiregion.schema_version()
            USING ERRCODE = '55000';
    END IF;
    v_rel := multiregion.range_relation(p_schema, p_table, p_partition);
    INSERT INTO multiregion.range_state (range_id, applied_index) VALUES (p_range, -1)
        ON CONFLICT (range_id) DO NOTHING;
    SELECT applied_index INTO v_at FROM multiregion.range_state WHERE range_id = p_range FOR UPDATE;
    IF v_at > p_index THEN
        RETURN false;
    END IF;
    PERFORM multiregion.lock_partition_parents(v_rel);
    PERFORM pg_catalog.set_config('session_replication_role', 'replica', true);
    EXECUTE format('DELETE FROM %s', v_rel);
    UPDATE multiregion.range_state SET applied_index = p_index, skip = coalesce(p_skip, '{}')
     WHERE range_id = p_range;
    RETURN true;
END
$fn$;
CREATE OR REPLACE FUNCTION multiregion.install_range_rows(p_schema text, p_table text, p_partition text, p_rows jsonb)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass := multiregion.range_relation(p_schema, p_table, p_partition);
    v_cols text;
BEGIN
    PERFORM multiregion.lock_partition_parents(v_rel);
    SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) INTO v_cols
      FROM pg_catalog.pg_attribute
     WHERE attrelid = v_rel AND attnum > 0 AND NOT attisdropped AND attgenerated = '';
    EXECUTE format('INSERT INTO %s (%s) OVERRIDING SYSTEM VALUE SELECT %s FROM jsonb_populate_recordset(NULL::%s, $1)',
                   v_rel, v_cols, v_cols, v_rel) USING p_rows;
END
$fn$;

-- Each node's turn for read-write REPEATABLE READ and SERIALIZABLE transactions over several
-- nodes (docs/ARCHITECTURE.md §8.5, "Isolation").
CREATE TABLE multiregion.turn (taken bigint NOT NULL);
INSERT INTO multiregion.turn VALUES (0);
REVOKE ALL ON multiregion.turn FROM PUBLIC;

-- A forwarded referential query that must see rows committed since the transaction's
-- snapshot runs as PostgreSQL runs it (docs/ARCHITECTURE.md §9, "Foreign keys across
-- leaseholders"): remote_exec's `crosscheck`.
DROP FUNCTION multiregion.remote_exec(text, text, text, text[], text[], text[]);
CREATE FUNCTION multiregion."remote_exec"(
	"role" TEXT,
	"gateway_region" TEXT,
	"sql" TEXT,
	"types" TEXT[],
	"vals" TEXT[],
	"partitions" TEXT[] DEFAULT '{}',
	"crosscheck" bool DEFAULT false
) RETURNS TABLE (
	"processed" bigint,
	"row" TEXT[],
	"moved" TEXT,
	"keys" TEXT,
	"deferred" TEXT,
	"wrote" bool
)
STRICT
LANGUAGE c
AS 'MODULE_PATHNAME', 'remote_exec_wrapper';
REVOKE EXECUTE ON FUNCTION multiregion.remote_exec(text, text, text, text[], text[], text[], bool) FROM PUBLIC;
