-- CREATE EXTENSION creates the schema multiregion, as a member of the extension, and the
-- functions in it.
CREATE EXTENSION pg_multiregion;
SELECT e.extname, e.extnamespace::regnamespace AS schema, e.extrelocatable
FROM pg_extension e WHERE e.extname = 'pg_multiregion';
SELECT pg_describe_object(classid, objid, objsubid) AS member
FROM pg_depend
WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
  AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'pg_multiregion')
ORDER BY 1;
\x on
SELECT p.proname, pg_get_function_arguments(p.oid) AS args,
       pg_get_function_result(p.oid) AS result, p.provolatile, p.proparallel
FROM pg_proc p
WHERE p.pronamespace = 'multiregion'::regnamespace
ORDER BY p.proname, args;
\x off
-- The views over the set-returning functions, column by column: names, order and types are
-- what the cluster tests and users rely on.
SELECT c.relname AS view, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod) AS type
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
WHERE c.relnamespace = 'multiregion'::regnamespace AND c.relkind = 'v' AND a.attnum > 0
ORDER BY c.relname, a.attnum;
-- Only set_cluster_setting is withheld from PUBLIC.
SELECT p.proname, p.proacl IS NOT NULL AS restricted
FROM pg_proc p
WHERE p.pronamespace = 'multiregion'::regnamespace
ORDER BY p.proname;
-- A multiregion schema that is not the extension's own is never adopted.
DROP EXTENSION pg_multiregion;
CREATE SCHEMA multiregion;
CREATE EXTENSION pg_multiregion;
DROP SCHEMA multiregion;
CREATE EXTENSION pg_multiregion;
