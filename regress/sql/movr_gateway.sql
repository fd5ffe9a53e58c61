-- The MovR tutorial through pgmr's SQL gateway (psql on node 1's gateway port): the schema as
-- the MovR app creates it, a little data, then the tutorial's Step 5 statements verbatim and in
-- order, as a user types them into psql. Rows and keys must be unchanged afterwards.
\set VERBOSITY default
\set QUIET off
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
ALTER DATABASE movr PRIMARY REGION "us-east1";
ALTER DATABASE movr ADD REGION "europe-west1";
ALTER DATABASE movr ADD REGION "us-west1";
ALTER TABLE promo_codes SET locality GLOBAL;
ALTER TABLE user_promo_codes
  ADD CONSTRAINT user_promo_codes_code_fk
    FOREIGN KEY (code)
    REFERENCES promo_codes (code)
    ON UPDATE CASCADE;
ALTER TABLE rides ADD COLUMN region crdb_internal_region AS (
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
) STORED;
ALTER TABLE rides ALTER COLUMN REGION SET NOT NULL;
ALTER TABLE rides SET LOCALITY REGIONAL BY ROW AS "region";
ALTER TABLE user_promo_codes ADD COLUMN region crdb_internal_region AS (
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
) STORED;
ALTER TABLE user_promo_codes ALTER COLUMN REGION SET NOT NULL;
ALTER TABLE user_promo_codes SET LOCALITY REGIONAL BY ROW AS "region";
ALTER TABLE users ADD COLUMN region crdb_internal_region AS (
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
) STORED;
ALTER TABLE users ALTER COLUMN REGION SET NOT NULL;
ALTER TABLE users SET LOCALITY REGIONAL BY ROW AS "region";
ALTER TABLE vehicle_location_histories ADD COLUMN region crdb_internal_region AS (
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
) STORED;
ALTER TABLE vehicle_location_histories ALTER COLUMN REGION SET NOT NULL;
ALTER TABLE vehicle_location_histories SET LOCALITY REGIONAL BY ROW AS "region";
ALTER TABLE vehicles ADD COLUMN region crdb_internal_region AS (
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
) STORED;
ALTER TABLE vehicles ALTER COLUMN REGION SET NOT NULL;
ALTER TABLE vehicles SET LOCALITY REGIONAL BY ROW AS "region";

-- Every row is still there, in its city's region.
SELECT t, b.count AS before, a.count AS after FROM counts_before b JOIN (
  SELECT 'users' t, count(*) FROM users UNION ALL SELECT 'vehicles', count(*) FROM vehicles
  UNION ALL SELECT 'rides', count(*) FROM rides
  UNION ALL SELECT 'vehicle_location_histories', count(*) FROM vehicle_location_histories
  UNION ALL SELECT 'promo_codes', count(*) FROM promo_codes
  UNION ALL SELECT 'user_promo_codes', count(*) FROM user_promo_codes) a USING (t) ORDER BY t;
SELECT region, count(*) FROM users GROUP BY region ORDER BY region;
SELECT table_name, locality FROM [SHOW TABLES];
SHOW REGIONS FROM DATABASE movr;
SELECT region FROM [SHOW REGIONS FROM DATABASE] WHERE "primary";
-- The app's writes: the region follows the city; a key is unique across regions.
INSERT INTO users (id, city, name, address, credit_card)
VALUES ('00000000-0000-0000-0000-000000000001', 'rome', 'Ada', 'Via 1', '4242') RETURNING region;
INSERT INTO users (id, city, name) VALUES ('00000000-0000-0000-0000-000000000001', 'boston', 'Bob');
UPSERT INTO promo_codes (code, description) VALUES ('code1', 'upserted'), ('code99', 'new');
SELECT code, description FROM promo_codes WHERE code IN ('code1', 'code99') ORDER BY code;
-- The schema as CockroachDB prints it: LOCALITY, the computed region column, keys without
-- the implicit region prefix; the foreign key checked in the row's region names the region.
SHOW CREATE TABLE vehicles;
SHOW CREATE TABLE promo_codes;
SELECT index_name, seq_in_index, column_name, implicit FROM [SHOW INDEXES FROM vehicles]
 ORDER BY 1, 2;
SELECT index_name, partition_name, partition_value, zone_config
  FROM [SHOW PARTITIONS FROM TABLE users] ORDER BY 1, 2;
SELECT table_name, count(*) FROM [SHOW PARTITIONS FROM DATABASE movr] GROUP BY 1 ORDER BY 1;
SHOW CREATE DATABASE movr;
