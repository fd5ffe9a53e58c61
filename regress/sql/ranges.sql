-- Ranges: every table of a cluster-wide database is replicated as one range per table, or one
-- per region partition of a REGIONAL BY ROW table, placed by the zone configuration on the
-- three-node cluster (one node per region: node 1 us-east1, node 2 us-west1, node 3
-- europe-west1). The meta group's leader derives the descriptors within a second or so of a
-- change, so each check first waits for the shape it expects.
\set VERBOSITY default
CREATE DATABASE regress_ranges;
\c regress_ranges
CREATE FUNCTION pg_temp.await(expected text) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE ok boolean;
BEGIN
  FOR i IN 1..200 LOOP
    EXECUTE expected INTO ok;
    IF ok THEN RETURN true; END IF;
    PERFORM pg_catalog.pg_sleep(0.1);
  END LOOP;
  RETURN false;
END $$;
CREATE VIEW pg_temp.my_ranges AS
  SELECT schema_name, table_name, partition, voting_replicas, non_voting_replicas, replica_regions
  FROM multiregion.ranges WHERE database_name = 'regress_ranges'
  ORDER BY table_name, schema_name, partition NULLS FIRST;

-- A database without regions: CockroachDB's default, three voters anywhere.
CREATE TABLE plain (id int PRIMARY KEY, v text);
SELECT pg_temp.await($$SELECT count(*) = 1 FROM pg_temp.my_ranges$$);
SELECT * FROM pg_temp.my_ranges;

-- Multi-region: voters and the lease at home, a non-voter in every other region. The
-- REGIONAL BY ROW table's key without its region is kept unique by a key table, a range of
-- its own in the primary region.
SELECT multiregion.execute('ALTER DATABASE regress_ranges PRIMARY REGION "us-east1"');
SELECT multiregion.execute('ALTER DATABASE regress_ranges ADD REGION "us-west1"');
SELECT multiregion.execute('ALTER DATABASE regress_ranges ADD REGION "europe-west1"');
SELECT multiregion.execute('CREATE TABLE promo (code text PRIMARY KEY) LOCALITY GLOBAL');
SELECT multiregion.execute('CREATE TABLE west (id int PRIMARY KEY) LOCALITY REGIONAL BY TABLE IN "us-west1"');
SELECT multiregion.execute('CREATE TABLE users (id int PRIMARY KEY, name text) LOCALITY REGIONAL BY ROW');
SELECT pg_temp.await($$SELECT count(*) = 7 AND bool_and(cardinality(voting_replicas) = 1)
                       FROM pg_temp.my_ranges$$);
SELECT * FROM pg_temp.my_ranges;

-- CockroachDB's SHOW RANGES columns; generations count each descriptor change.
SELECT bool_and(generation >= 1) AS generations FROM multiregion.ranges;
SELECT attname FROM pg_catalog.pg_attribute
 WHERE attrelid = 'multiregion.ranges'::regclass AND attnum > 0 ORDER BY attnum;

-- SHOW RANGES through execute(): the current database, one table, another database.
SELECT e->>'table_name' AS table_name, e->>'partition' AS partition
  FROM multiregion.execute('SHOW RANGES FROM TABLE users') e ORDER BY 2;
SELECT count(*) = (SELECT count(*) FROM pg_temp.my_ranges) AS all_ranges
  FROM multiregion.execute('SHOW RANGES') e;
SELECT count(*) AS none FROM multiregion.execute('SHOW RANGES FROM DATABASE nosuch');
SELECT * FROM multiregion.execute('SHOW RANGES FROM TABLE nosuch');

-- Surviving a region failure: voters in every region.
SELECT multiregion.execute('ALTER DATABASE regress_ranges SURVIVE REGION FAILURE');
SELECT pg_temp.await($$SELECT bool_and(cardinality(voting_replicas) = 3) FROM pg_temp.my_ranges
                       WHERE table_name <> 'plain'$$);
SELECT * FROM pg_temp.my_ranges;
SELECT multiregion.execute('ALTER DATABASE regress_ranges SURVIVE ZONE FAILURE');

-- A region dropped takes its partition's range with it; a dropped table takes its ranges.
SELECT multiregion.execute('ALTER TABLE users SET LOCALITY GLOBAL');
SELECT multiregion.execute('ALTER DATABASE regress_ranges DROP REGION "europe-west1"');
DROP TABLE west;
SELECT pg_temp.await($$SELECT count(*) = 3 AND bool_and(cardinality(voting_replicas) = 1)
                       FROM pg_temp.my_ranges$$);
SELECT * FROM pg_temp.my_ranges;
\c regress_mr
