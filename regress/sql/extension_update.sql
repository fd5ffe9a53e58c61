-- ALTER EXTENSION pg_multiregion UPDATE from every older release (sql/) ends where a fresh
-- install of the current version starts: the same member objects, the same function
-- definitions, the same table columns. The older version's objects are recorded after the
-- update, the extension dropped and created fresh, and the two compared. Run where no pgmr
-- is configured (the unconfigured phase), so that DDL stays on this server.
CREATE FUNCTION pg_temp.members() RETURNS TABLE (member text, definition text)
LANGUAGE sql AS $$
  SELECT pg_describe_object(d.classid, d.objid, d.objsubid),
         CASE WHEN d.classid = 'pg_proc'::regclass
              THEN md5(pg_get_functiondef(d.objid))
              WHEN d.classid = 'pg_class'::regclass
              THEN (SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                                      || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END,
                                      ', ' ORDER BY a.attnum)
                      FROM pg_attribute a
                     WHERE a.attrelid = d.objid AND a.attnum > 0 AND NOT a.attisdropped)
         END
    FROM pg_depend d
   WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
     AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'pg_multiregion')
$$;
CREATE EXTENSION pg_multiregion VERSION '0.1.0';
SELECT extversion FROM pg_extension WHERE extname = 'pg_multiregion';
SELECT count(*) AS sequence_functions FROM pg_proc
 WHERE pronamespace = 'multiregion'::regnamespace AND proname IN ('nextval', 'setval');
ALTER EXTENSION pg_multiregion UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'pg_multiregion';
CREATE TEMP TABLE updated AS SELECT * FROM pg_temp.members();
DROP EXTENSION pg_multiregion;
CREATE EXTENSION pg_multiregion;
CREATE TEMP TABLE fresh AS SELECT * FROM pg_temp.members();
-- Both empty: nothing only one of them has.
(SELECT 'only after the update' AS side, * FROM updated EXCEPT SELECT 'only after the update', * FROM fresh)
UNION ALL
(SELECT 'only when fresh', * FROM fresh EXCEPT SELECT 'only when fresh', * FROM updated)
ORDER BY 1, 2;
SELECT count(*) > 80 AS compared FROM fresh;
-- Sequences that exist when the extension is updated get their keys.
DROP EXTENSION pg_multiregion;
CREATE SEQUENCE before_update;
CREATE EXTENSION pg_multiregion VERSION '0.1.0';
ALTER EXTENSION pg_multiregion UPDATE TO '0.2.0';
SELECT nspname, relname FROM multiregion.sequence_keys;
DROP SEQUENCE before_update;
DROP EXTENSION pg_multiregion;
