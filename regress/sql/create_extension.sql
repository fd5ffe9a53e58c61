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
ORDER BY p.proname;
\x off
-- A multiregion schema that is not the extension's own is never adopted.
DROP EXTENSION pg_multiregion;
CREATE SCHEMA multiregion;
CREATE EXTENSION pg_multiregion;
DROP SCHEMA multiregion;
CREATE EXTENSION pg_multiregion;
