-- The settings, as preload.conf set them.
SELECT name, setting, unit, context, vartype, boot_val, min_val, max_val
FROM pg_settings WHERE name LIKE 'multiregion.%' ORDER BY name;
-- A malformed locality is refused by the check hook, with the problem and a hint.
ALTER SYSTEM SET multiregion.locality = 'us-east1';
ALTER SYSTEM SET multiregion.locality = 'zone=us-east1-b';
ALTER SYSTEM SET multiregion.locality = 'region=us east1';
ALTER SYSTEM SET multiregion.locality = 'region=us-east1,region=us-west1';
ALTER SYSTEM SET multiregion.locality = 'region=,zone=b';
ALTER SYSTEM SET multiregion.locality = 'region=us-east1,,zone=us-east1-b';
ALTER SYSTEM SET multiregion.locality = 'region=''us-east1''';
\echo :SQLSTATE
-- A well-formed one is written to postgresql.auto.conf, takes effect only after a restart,
-- and can be reset.
ALTER SYSTEM SET multiregion.locality = 'cloud=gce, region=europe-west1 ,zone=europe-west1-c';
SELECT setting, applied, error FROM pg_file_settings
WHERE name = 'multiregion.locality' ORDER BY seqno;
SHOW multiregion.locality;
ALTER SYSTEM RESET multiregion.locality;
SELECT setting, applied, error FROM pg_file_settings
WHERE name = 'multiregion.locality' ORDER BY seqno;
-- Locality and socket are postmaster-level: a session cannot change them.
SET multiregion.locality = 'region=us-west1';
\echo :SQLSTATE
SET multiregion.sidecar_socket = '/tmp/other.sock';
-- The timeout is per session, in milliseconds, between 10 ms and 60 s.
SET multiregion.sidecar_timeout = 5;
SET multiregion.sidecar_timeout = '61s';
SET multiregion.sidecar_timeout = '1.5s';
SHOW multiregion.sidecar_timeout;
RESET multiregion.sidecar_timeout;
SHOW multiregion.sidecar_timeout;
-- The prefix is reserved, so a misspelt setting is an error rather than a silent placeholder.
SET multiregion.localty = 'region=us-east1';
