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
