-- Without shared_preload_libraries the library refuses to load, whichever way it is asked to,
-- and keeps refusing: nothing is left half-initialised by a failed attempt.
CREATE EXTENSION pg_multiregion;
CREATE EXTENSION pg_multiregion;
LOAD 'pg_multiregion';
SELECT count(*) FROM pg_extension WHERE extname = 'pg_multiregion';
SELECT count(*) FROM pg_namespace WHERE nspname = 'multiregion';
