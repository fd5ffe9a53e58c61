-- The MovR tutorial on the native door: the schema as the MovR app creates it, a little data,
-- then the tutorial's Step 5 statements, verbatim and in order, through multiregion.execute.
-- Rows, constraints and foreign keys must be unchanged, and enforced, afterwards.
\set VERBOSITY default
CREATE DATABASE movr;
\c movr
CREATE TABLE users (id UUID NOT NULL, city VARCHAR NOT NULL, name VARCHAR, address VARCHAR,
    credit_card VARCHAR, PRIMARY KEY (id));
CREATE TABLE vehicles (id UUID NOT NULL, city VARCHAR NOT NULL, type VARCHAR, owner_id UUID,
    creation_time TIMESTAMP, status VARCHAR, current_location VARCHAR, ext JSONB,
    PRIMARY KEY (id), FOREIGN KEY (owner_id) REFERENCES users (id));
CREATE TABLE rides (id UUID NOT NULL, city VARCHAR NOT NULL, rider_id UUID, vehicle_id UUID,
    start_address VARCHAR, end_address VARCHAR, start_time TIMESTAMP, end_time TIMESTAMP,
    revenue DECIMAL(10, 2), PRIMARY KEY (id), FOREIGN KEY (vehicle_id) REFERENCES vehicles (id));
CREATE TABLE vehicle_location_histories (city VARCHAR NOT NULL, ride_id UUID NOT NULL,
    "timestamp" TIMESTAMP NOT NULL, lat FLOAT, long FLOAT, PRIMARY KEY (ride_id, "timestamp"),
    FOREIGN KEY (ride_id) REFERENCES rides (id));
CREATE TABLE promo_codes (code VARCHAR NOT NULL, description VARCHAR, creation_time TIMESTAMP,
    expiration_time TIMESTAMP, rules JSONB, PRIMARY KEY (code));
CREATE TABLE user_promo_codes (city VARCHAR NOT NULL, user_id UUID NOT NULL, code VARCHAR NOT NULL,
    "timestamp" TIMESTAMP, usage_count INT, PRIMARY KEY (user_id, code),
    FOREIGN KEY (user_id) REFERENCES users (id));

-- Nine cities, three per region; deterministic ids.
CREATE TEMP TABLE cities AS SELECT * FROM unnest(ARRAY['amsterdam', 'paris', 'rome', 'new york',
    'boston', 'washington dc', 'san francisco', 'seattle', 'los angeles']) WITH ORDINALITY c(city, n);
INSERT INTO users SELECT md5('user' || i)::uuid, c.city, 'user ' || i, i || ' Main St', 'cc' || i
  FROM generate_series(1, 45) i JOIN cities c ON c.n = i % 9 + 1;
INSERT INTO vehicles SELECT md5('vehicle' || i)::uuid, u.city, 'scooter', u.id,
       '2026-01-01'::timestamp + i * interval '1 hour', 'available', i || ' Elm St', '{"color": "red"}'
  FROM generate_series(1, 18) i JOIN users u ON u.id = md5('user' || i)::uuid;
INSERT INTO rides SELECT md5('ride' || i)::uuid, v.city, md5('user' || (i % 45 + 1))::uuid, v.id,
       'a', 'b', '2026-02-01'::timestamp + i * interval '1 minute', NULL, i % 50
  FROM generate_series(1, 36) i JOIN vehicles v ON v.id = md5('vehicle' || (i % 18 + 1))::uuid;
INSERT INTO vehicle_location_histories SELECT r.city, r.id, r.start_time + j * interval '1 s', j, -j
  FROM rides r, generate_series(1, 3) j;
INSERT INTO promo_codes SELECT 'code' || i, 'promo ' || i, '2026-01-01', '2027-01-01', '{}'
  FROM generate_series(1, 10) i;
INSERT INTO user_promo_codes SELECT u.city, u.id, 'code' || (i % 10 + 1), '2026-03-01', 1
  FROM generate_series(1, 20) i JOIN users u ON u.id = md5('user' || i)::uuid;
CREATE TEMP TABLE counts_before AS
SELECT 'users' t, count(*) FROM users UNION ALL SELECT 'vehicles', count(*) FROM vehicles
UNION ALL SELECT 'rides', count(*) FROM rides
UNION ALL SELECT 'vehicle_location_histories', count(*) FROM vehicle_location_histories
UNION ALL SELECT 'promo_codes', count(*) FROM promo_codes
UNION ALL SELECT 'user_promo_codes', count(*) FROM user_promo_codes;

-- Step 5, verbatim.
SELECT multiregion.execute($$ALTER DATABASE movr PRIMARY REGION "us-east1"$$);
SELECT multiregion.execute($$ALTER DATABASE movr ADD REGION "europe-west1"$$);
SELECT multiregion.execute($$ALTER DATABASE movr ADD REGION "us-west1"$$);
SELECT multiregion.execute($$ALTER TABLE promo_codes SET locality GLOBAL$$);
SELECT multiregion.execute($$ALTER TABLE user_promo_codes
  ADD CONSTRAINT user_promo_codes_code_fk
    FOREIGN KEY (code)
    REFERENCES promo_codes (code)
    ON UPDATE CASCADE$$);
SELECT multiregion.execute($$ALTER TABLE rides ADD COLUMN region crdb_internal_region AS (
  CASE WHEN city = 'amsterdam' THEN 'europe-west1'
       WHEN city = 'paris' THEN 'europe-west1'
       WHEN city = 'rome' THEN 'europe-west1'
       WHEN city = 'new york' THEN 'us-east1'
       WHEN city = 'boston' THEN 'us-east1'
       WHEN city = 'washington dc' THEN 'us-east1'
       WHEN city = 'san francisco' THEN 'us-west1'
       WHEN city = 'seattle' THEN 'us-west1'
       WHEN city = 'los angeles' THEN 'us-west1'
  END
) STORED$$);
SELECT multiregion.execute($$ALTER TABLE rides ALTER COLUMN REGION SET NOT NULL$$);
SELECT multiregion.execute($$ALTER TABLE rides SET LOCALITY REGIONAL BY ROW AS "region"$$);
SELECT multiregion.execute($$ALTER TABLE user_promo_codes ADD COLUMN region crdb_internal_region AS (
  CASE WHEN city = 'amsterdam' THEN 'europe-west1'
       WHEN city = 'paris' THEN 'europe-west1'
       WHEN city = 'rome' THEN 'europe-west1'
       WHEN city = 'new york' THEN 'us-east1'
       WHEN city = 'boston' THEN 'us-east1'
       WHEN city = 'washington dc' THEN 'us-east1'
       WHEN city = 'san francisco' THEN 'us-west1'
       WHEN city = 'seattle' THEN 'us-west1'
       WHEN city = 'los angeles' THEN 'us-west1'
  END
) STORED$$);
SELECT multiregion.execute($$ALTER TABLE user_promo_codes ALTER COLUMN REGION SET NOT NULL$$);
SELECT multiregion.execute($$ALTER TABLE user_promo_codes SET LOCALITY REGIONAL BY ROW AS "region"$$);
SELECT multiregion.execute($$ALTER TABLE users ADD COLUMN region crdb_internal_region AS (
  CASE WHEN city = 'amsterdam' THEN 'europe-west1'
       WHEN city = 'paris' THEN 'europe-west1'
       WHEN city = 'rome' THEN 'europe-west1'
       WHEN city = 'new york' THEN 'us-east1'
       WHEN city = 'boston' THEN 'us-east1'
       WHEN city = 'washington dc' THEN 'us-east1'
       WHEN city = 'san francisco' THEN 'us-west1'
       WHEN city = 'seattle' THEN 'us-west1'
       WHEN city = 'los angeles' THEN 'us-west1'
  END
) STORED$$);
SELECT multiregion.execute($$ALTER TABLE users ALTER COLUMN REGION SET NOT NULL$$);
SELECT multiregion.execute($$ALTER TABLE users SET LOCALITY REGIONAL BY ROW AS "region"$$);
SELECT multiregion.execute($$ALTER TABLE vehicle_location_histories ADD COLUMN region crdb_internal_region AS (
  CASE WHEN city = 'amsterdam' THEN 'europe-west1'
       WHEN city = 'paris' THEN 'europe-west1'
       WHEN city = 'rome' THEN 'europe-west1'
       WHEN city = 'new york' THEN 'us-east1'
       WHEN city = 'boston' THEN 'us-east1'
       WHEN city = 'washington dc' THEN 'us-east1'
       WHEN city = 'san francisco' THEN 'us-west1'
       WHEN city = 'seattle' THEN 'us-west1'
       WHEN city = 'los angeles' THEN 'us-west1'
  END
) STORED$$);
SELECT multiregion.execute($$ALTER TABLE vehicle_location_histories ALTER COLUMN REGION SET NOT NULL$$);
SELECT multiregion.execute($$ALTER TABLE vehicle_location_histories SET LOCALITY REGIONAL BY ROW AS "region"$$);
SELECT multiregion.execute($$ALTER TABLE vehicles ADD COLUMN region crdb_internal_region AS (
  CASE WHEN city = 'amsterdam' THEN 'europe-west1'
       WHEN city = 'paris' THEN 'europe-west1'
       WHEN city = 'rome' THEN 'europe-west1'
       WHEN city = 'new york' THEN 'us-east1'
       WHEN city = 'boston' THEN 'us-east1'
       WHEN city = 'washington dc' THEN 'us-east1'
       WHEN city = 'san francisco' THEN 'us-west1'
       WHEN city = 'seattle' THEN 'us-west1'
       WHEN city = 'los angeles' THEN 'us-west1'
  END
) STORED$$);
SELECT multiregion.execute($$ALTER TABLE vehicles ALTER COLUMN REGION SET NOT NULL$$);
SELECT multiregion.execute($$ALTER TABLE vehicles SET LOCALITY REGIONAL BY ROW AS "region"$$);

-- Every row is still there, in its city's region.
SELECT t, b.count AS before, a.count AS after FROM counts_before b JOIN (
  SELECT 'users' t, count(*) FROM users UNION ALL SELECT 'vehicles', count(*) FROM vehicles
  UNION ALL SELECT 'rides', count(*) FROM rides
  UNION ALL SELECT 'vehicle_location_histories', count(*) FROM vehicle_location_histories
  UNION ALL SELECT 'promo_codes', count(*) FROM promo_codes
  UNION ALL SELECT 'user_promo_codes', count(*) FROM user_promo_codes) a USING (t) ORDER BY t;
SELECT region, count(*) FROM users GROUP BY region ORDER BY region;
SELECT tableoid::regclass AS partition, count(*) FROM rides GROUP BY 1 ORDER BY 1;
SELECT table_name, locality FROM multiregion.tables;
-- The constraints, as PostgreSQL lists them (keys now lead with the region).
SELECT con.conrelid::regclass AS "table", con.conname, pg_catalog.pg_get_constraintdef(con.oid) AS definition
  FROM pg_catalog.pg_constraint con JOIN pg_catalog.pg_class c ON c.oid = con.conrelid
 WHERE con.connamespace IN ('public'::regnamespace, 'multiregion_keys'::regnamespace)
   AND con.contype IN ('p', 'u', 'f') AND NOT c.relispartition
 ORDER BY 1::text, 2;

-- The app's writes: the region follows the city.
INSERT INTO users (id, city, name, address, credit_card)
VALUES ('00000000-0000-0000-0000-000000000001', 'rome', 'Ada', 'Via 1', '4242') RETURNING region;
INSERT INTO vehicles (id, city, type, owner_id, creation_time, status, current_location, ext)
VALUES ('00000000-0000-0000-0000-0000000000f1', 'rome', 'bike',
        '00000000-0000-0000-0000-000000000001', now(), 'available', 'Piazza', '{}') RETURNING region;
INSERT INTO rides (id, city, rider_id, vehicle_id, start_address, start_time)
VALUES ('00000000-0000-0000-0000-0000000000a1', 'seattle', '00000000-0000-0000-0000-000000000001',
        '00000000-0000-0000-0000-0000000000f1', 'Pike St', now()) RETURNING region;
INSERT INTO vehicle_location_histories (city, ride_id, "timestamp", lat, long)
VALUES ('seattle', '00000000-0000-0000-0000-0000000000a1', '2026-05-01', 47.6, -122.3) RETURNING region;
UPDATE rides SET end_address = 'Pine St', end_time = now(), revenue = 3.50
 WHERE id = '00000000-0000-0000-0000-0000000000a1' RETURNING region, revenue;

-- Constraints still hold: primary keys across regions, foreign keys, NOT NULL.
INSERT INTO users (id, city, name) VALUES ('00000000-0000-0000-0000-000000000001', 'boston', 'Bob');
\echo :SQLSTATE
INSERT INTO vehicles (id, city, owner_id)
VALUES ('00000000-0000-0000-0000-0000000000f2', 'paris', '00000000-0000-0000-0000-0000000000ff');
\echo :SQLSTATE
INSERT INTO rides (id, city, vehicle_id)
VALUES ('00000000-0000-0000-0000-0000000000a2', 'paris', '00000000-0000-0000-0000-0000000000ff');
\echo :SQLSTATE
INSERT INTO vehicle_location_histories (city, ride_id, "timestamp")
VALUES ('paris', '00000000-0000-0000-0000-0000000000ff', now());
\echo :SQLSTATE
INSERT INTO user_promo_codes (city, user_id, code) VALUES ('rome', '00000000-0000-0000-0000-000000000001', 'nope');
\echo :SQLSTATE
INSERT INTO users (id, city) VALUES ('00000000-0000-0000-0000-000000000002', NULL);
\echo :SQLSTATE
DELETE FROM users WHERE id = '00000000-0000-0000-0000-000000000001';
\echo :SQLSTATE
-- ON UPDATE CASCADE into the REGIONAL BY ROW user_promo_codes, from the GLOBAL promo_codes.
UPDATE promo_codes SET code = 'code1-renamed' WHERE code = 'code1';
SELECT count(*) FROM user_promo_codes WHERE code = 'code1-renamed';
-- A user moves city: the row changes region, its vehicles still reference it.
UPDATE users SET city = 'boston' WHERE id = '00000000-0000-0000-0000-000000000001' RETURNING region;
SELECT count(*) FROM vehicles v JOIN users u ON u.id = v.owner_id
 WHERE u.id = '00000000-0000-0000-0000-000000000001';

-- The other nodes have the same schema.
\c movr - - 17534
SELECT table_name, locality FROM multiregion.tables;
SELECT region, "primary" FROM multiregion.regions;
-- Every node lists every database's regions (from the meta group).
SELECT * FROM multiregion.execute('SHOW REGIONS FROM ALL DATABASES');
SELECT * FROM multiregion.execute('SHOW REGIONS');
