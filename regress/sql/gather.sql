-- The functions a gathered read is re-planned over (gather.rs, partial_agg.rs) take trees
-- only PostgreSQL builds, and refuse anything else with SQLSTATE 22023 before reading a row.
-- (No pgmr here, so no table is created: a catalog stands in for one.)
SELECT multiregion.gather_partials(NULL, '{}', NULL);
\echo :SQLSTATE
SELECT multiregion.gather_partials('pg_class'::regclass, '{}', NULL);
\echo :SQLSTATE
-- A tree from the catalogs is a pg_node_tree too, but not a list of aggregates over the
-- table, nor a filter over its columns.
SELECT multiregion.gather_partials('pg_class'::regclass, '{}',
       (SELECT ev_action FROM pg_rewrite WHERE ev_class = 'pg_roles'::regclass));
\echo :SQLSTATE
SELECT multiregion.gather_rows('pg_class'::regclass, NULL,
       (SELECT ev_action FROM pg_rewrite WHERE ev_class = 'pg_roles'::regclass));
\echo :SQLSTATE
-- Grouping columns that are not the table's.
SELECT multiregion.gather_partials('pg_class'::regclass, '{999}',
       (SELECT ev_action FROM pg_rewrite WHERE ev_class = 'pg_roles'::regclass));
\echo :SQLSTATE
