-- The multi-region catalog of one database: this node's applied copy of what the meta Raft
-- group records for it (docs/ARCHITECTURE.md §7). Only the extension writes these tables, as
-- their owner, after checking the caller's privileges; everyone may read them.

-- One row, always present. primary_region IS NULL means the database is not multi-region.
-- schema_version counts the multi-region schema changes applied here, in the meta group's
-- order; a replicated change applies only on top of the version before it.
CREATE TABLE multiregion.database_config (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    primary_region text,
    regions text[] NOT NULL DEFAULT '{}',
    survival_goal text NOT NULL DEFAULT 'zone' CHECK (survival_goal IN ('zone', 'region')),
    placement text NOT NULL DEFAULT 'default' CHECK (placement IN ('default', 'restricted')),
    secondary_region text,
    schema_version bigint NOT NULL DEFAULT 0,
    CHECK (primary_region IS NULL OR primary_region = ANY (regions))
);
INSERT INTO multiregion.database_config DEFAULT VALUES;

-- Tables with a locality other than the default (REGIONAL BY TABLE IN PRIMARY REGION).
CREATE TABLE multiregion.table_locality (
    relid oid PRIMARY KEY,
    locality text NOT NULL CHECK (locality IN ('regional_by_table', 'regional_by_row', 'global')),
    -- REGIONAL BY TABLE IN region; NULL means the primary region.
    region text,
    -- REGIONAL BY ROW: the region column, and whether it is the system-provided, hidden one.
    region_column name,
    hidden boolean NOT NULL DEFAULT false,
    -- REGIONAL BY ROW AS a stored computed column: its expression (pg_node_tree text), which
    -- the extension computes on INSERT and UPDATE because PostgreSQL cannot partition by a
    -- generated column.
    region_expr text,
    region_expr_sql text,
    auto_rehoming boolean NOT NULL DEFAULT false,
    CHECK ((locality = 'regional_by_row') = (region_column IS NOT NULL))
);

-- Unique constraints of REGIONAL BY ROW tables that do not include the region column. Each is
-- enforced across all partitions by a key table in schema multiregion_keys, whose own unique
-- index PostgreSQL checks under every isolation level, and which foreign keys reference.
CREATE TABLE multiregion.global_key (
    relid oid NOT NULL,
    constraint_name name NOT NULL,
    key_table regclass NOT NULL,
    columns name[] NOT NULL,
    PRIMARY KEY (relid, constraint_name)
);

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

CREATE SCHEMA multiregion_keys;
COMMENT ON SCHEMA multiregion_keys IS
    'pg_multiregion: the keys of REGIONAL BY ROW tables that must be unique across regions';

GRANT USAGE ON SCHEMA multiregion TO PUBLIC;
GRANT USAGE ON SCHEMA multiregion_keys TO PUBLIC;
GRANT SELECT ON multiregion.database_config, multiregion.table_locality, multiregion.global_key,
    multiregion.sequence_keys TO PUBLIC;

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

-- Maintains a global key table from a REGIONAL BY ROW table's row triggers. With row
-- replication on, the key table is a replicated range and the change is only recorded, for
-- the transaction's origin to apply at its leaseholder (global_keys.rs). Otherwise each node
-- keeps its own key table, and the checks read this node's copy as it is
-- (multiregion.count_local: no routing, no read barrier). A key leaves the
-- key table only when no row holds it any more, so a row that moves between partitions (a
-- rehome: PostgreSQL runs it as a DELETE and an INSERT) neither loses its key nor cascades a
-- delete to rows that reference it. Runs as the extension's owner, so writers need no
-- privilege on the key table; it refuses to run for a key table that is not this table's.
CREATE FUNCTION multiregion.maintain_global_key() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_key_table regclass := TG_ARGV[0]::regclass;
    v_constraint text := TG_ARGV[1];
    cols name[];
    parent regclass;
    old_key jsonb;
    new_key jsonb;
    key_cols text;
    match_old text;
    match_new text;
    inserted int;
    holders bigint;
BEGIN
    SELECT g.columns, g.relid INTO cols, parent FROM multiregion.global_key g
     WHERE g.relid = TG_RELID AND g.key_table = v_key_table
       AND g.constraint_name = v_constraint;
    IF cols IS NULL THEN
        -- A partition's clone of the parent's trigger: the catalog names the parent.
        SELECT g.columns, g.relid INTO cols, parent FROM multiregion.global_key g
          JOIN pg_catalog.pg_inherits i ON i.inhparent = g.relid
         WHERE i.inhrelid = TG_RELID AND g.key_table = v_key_table
           AND g.constraint_name = v_constraint;
    END IF;
    IF cols IS NULL THEN
        RAISE EXCEPTION 'key table % does not belong to table %', v_key_table, TG_RELID::regclass
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    SELECT string_agg(format('%I', c), ', ' ORDER BY o) INTO key_cols
      FROM unnest(cols) WITH ORDINALITY AS u(c, o);
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        old_key := (SELECT jsonb_object_agg(c, to_jsonb(OLD) -> c) FROM unnest(cols) c);
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') THEN
        new_key := (SELECT jsonb_object_agg(c, to_jsonb(NEW) -> c) FROM unnest(cols) c);
    END IF;
    IF TG_OP = 'UPDATE' AND old_key IS NOT DISTINCT FROM new_key THEN
        RETURN NULL;
    END IF;
    -- With row replication on, the key table is a replicated range: the change is applied
    -- at its leaseholder after the statement, by the transaction's origin (global_keys.rs).
    IF multiregion.record_key_change(v_key_table, parent, v_constraint,
           CASE WHEN NOT EXISTS (SELECT 1 FROM jsonb_each(old_key) e WHERE e.value = 'null')
                THEN old_key END,
           CASE WHEN NOT EXISTS (SELECT 1 FROM jsonb_each(new_key) e WHERE e.value = 'null')
                THEN new_key END) THEN
        RETURN NULL;
    END IF;
    -- Keys with a NULL part are not unique (SQL's rule), so they have no entry.
    IF old_key IS NOT NULL AND NOT EXISTS (SELECT 1 FROM jsonb_each(old_key) e WHERE e.value = 'null') THEN
        match_old := (SELECT string_agg(format('%I = ($1 ->> %L)::%s', c, c,
                                               format_type(a.atttypid, a.atttypmod)), ' AND ')
                        FROM unnest(cols) c
                        JOIN pg_catalog.pg_attribute a ON a.attrelid = v_key_table AND a.attname = c);
        holders := multiregion.count_local(
            format('SELECT count(*) FROM (SELECT 1 FROM %s WHERE %s LIMIT 1) s', parent, match_old),
            old_key);
        IF holders = 0 THEN
            IF TG_OP = 'UPDATE' AND new_key IS NOT NULL
               AND NOT EXISTS (SELECT 1 FROM jsonb_each(new_key) e WHERE e.value = 'null') THEN
                -- An UPDATE of the key: update the key in place, so that ON UPDATE actions of
                -- the foreign keys that reference it apply.
                EXECUTE format('UPDATE %s SET (%s) = (SELECT %s FROM jsonb_populate_record(NULL::%s, $2)) WHERE %s',
                               v_key_table, key_cols, key_cols, v_key_table, match_old)
                    USING old_key, new_key;
                RETURN NULL;
            END IF;
            EXECUTE format('DELETE FROM %s WHERE %s', v_key_table, match_old) USING old_key;
        END IF;
    END IF;
    IF new_key IS NOT NULL AND NOT EXISTS (SELECT 1 FROM jsonb_each(new_key) e WHERE e.value = 'null') THEN
        EXECUTE format('INSERT INTO %s SELECT * FROM jsonb_populate_record(NULL::%s, $1) ON CONFLICT DO NOTHING',
                       v_key_table, v_key_table) USING new_key;
        GET DIAGNOSTICS inserted = ROW_COUNT;
        IF inserted = 0 THEN
            -- The key exists: fine if this row is its only holder (it moved partitions),
            -- a duplicate otherwise.
            match_new := (SELECT string_agg(format('%I = ($1 ->> %L)::%s', c, c,
                                                   format_type(a.atttypid, a.atttypmod)), ' AND ')
                            FROM unnest(cols) c
                            JOIN pg_catalog.pg_attribute a ON a.attrelid = v_key_table AND a.attname = c);
            holders := multiregion.count_local(
                format('SELECT count(*) FROM (SELECT 1 FROM %s WHERE %s LIMIT 2) s', parent, match_new),
                new_key);
            -- A replica applies what the leaseholders decided, in each range's own order: a
            -- row moved between ranges may arrive before its old copy leaves.
            IF holders > 1 AND current_setting('session_replication_role') <> 'replica' THEN
                RAISE EXCEPTION 'duplicate key value violates unique constraint "%"', v_constraint
                    USING ERRCODE = 'unique_violation',
                          DETAIL = format('Key (%s)=(%s) already exists.', array_to_string(cols, ', '),
                                          (SELECT string_agg(e.value #>> '{}', ', ' ORDER BY o)
                                             FROM unnest(cols) WITH ORDINALITY u(c, o)
                                             JOIN jsonb_each(new_key) e ON e.key = u.c)),
                          CONSTRAINT = v_constraint,
                          TABLE = TG_TABLE_NAME,
                          SCHEMA = TG_TABLE_SCHEMA;
            END IF;
        END IF;
    END IF;
    RETURN NULL;
END
$fn$;

-- TRUNCATE of a REGIONAL BY ROW table releases every key of each of its global key tables:
-- at the key table's leaseholder after the statement with row replication on, here
-- otherwise. (TRUNCATE fires no row trigger.)
CREATE FUNCTION multiregion.truncate_global_key() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_key_table regclass := TG_ARGV[0]::regclass;
    v_constraint text := TG_ARGV[1];
BEGIN
    IF NOT EXISTS (SELECT FROM multiregion.global_key g
                    WHERE g.relid = TG_RELID AND g.key_table = v_key_table
                      AND g.constraint_name = v_constraint) THEN
        RAISE EXCEPTION 'key table % does not belong to table %', v_key_table, TG_RELID::regclass
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF NOT multiregion.record_keys_truncated(v_key_table, TG_RELID, v_constraint) THEN
        EXECUTE format('DELETE FROM %s', v_key_table);
    END IF;
    RETURN NULL;
END
$fn$;

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
CREATE FUNCTION multiregion.forget_dropped() RETURNS event_trigger
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
CREATE EVENT TRIGGER multiregion_forget_dropped ON sql_drop
    EXECUTE FUNCTION multiregion.forget_dropped();
