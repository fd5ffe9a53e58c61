"""An application written for CockroachDB, unchanged, through pgmr's SQL gateway.

SQLAlchemy 1.4 with CockroachDB's own dialect (sqlalchemy-cockroachdb) and its URL form
(cockroachdb://root@host:port/db), in the MovR app's patterns: the ORM creates the schema,
run_transaction wraps every unit of work in BEGIN + SAVEPOINT cockroach_restart and retries
40001, then the app converts the database to multi-region exactly as MovR's
configure-multi-region does: it reads the regions with SELECT region FROM [SHOW REGIONS]
and the cities through a session it leaves open in its transaction, runs the region and
locality DDL in separate transactions, and assigns each row's crdb_region. Exits non-zero
on the first thing that does not behave as on CockroachDB.

Usage: movr_like.py GATEWAY_PORT [DATABASE]   (the database, movr_app by default, must exist)
"""

import sys
import uuid

from sqlalchemy import Column, ForeignKey, String, create_engine, text
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.orm import declarative_base, sessionmaker
from sqlalchemy_cockroachdb import run_transaction

PORT = sys.argv[1]
DATABASE = sys.argv[2] if len(sys.argv) > 2 else "movr_app"
URL = f"cockroachdb://root@127.0.0.1:{PORT}/{DATABASE}?sslmode=disable&application_name=movr-like"
CITIES = {
    "us-east1": ["new york", "boston"],
    "us-west1": ["seattle"],
    "europe-west1": ["paris", "rome"],
}

Base = declarative_base()


class User(Base):
    __tablename__ = "users"
    id = Column(UUID, primary_key=True)
    city = Column(String, nullable=False)
    name = Column(String)


class Vehicle(Base):
    __tablename__ = "vehicles"
    id = Column(UUID, primary_key=True)
    city = Column(String, nullable=False)
    owner_id = Column(UUID, ForeignKey("users.id"))


class PromoCode(Base):
    __tablename__ = "promo_codes"
    code = Column(String, primary_key=True)
    description = Column(String)


def check(what, got, want):
    if got != want:
        sys.exit(f"movr_like: {what}: got {got!r}, want {want!r}")
    print(f"ok: {what}")


engine = create_engine(URL)
Session = sessionmaker(bind=engine)

# The dialect's connect (select version(), crdb_internal.increment_feature_counter, …) and
# the ORM's schema, dropped first as MovR's load does when tables exist.
Base.metadata.drop_all(engine)
Base.metadata.create_all(engine)


def load(session):
    for i, city in enumerate(c for cs in CITIES.values() for c in cs for _ in range(3)):
        uid = str(uuid.UUID(int=i + 1))
        session.add(User(id=uid, city=city, name=f"user {i}"))
        session.flush()
        session.add(Vehicle(id=str(uuid.UUID(int=1000 + i)), city=city, owner_id=uid))
    session.add(PromoCode(code="welcome", description="10% off"))


run_transaction(Session, load)

# configure-multi-region, as MovR does it: a reader left open in its transaction …
reader = Session()
regions = sorted(r[0] for r in reader.execute(text("SELECT region FROM [SHOW REGIONS]")))
check("regions from [SHOW REGIONS]", regions, sorted(CITIES))
cities = sorted(c for (c,) in reader.query(User.city).distinct().all())
check("cities", cities, sorted(c for cs in CITIES.values() for c in cs))
db = reader.execute(text("SELECT current_database()")).scalar()

# … while the schema changes run, each in its own run_transaction.
statements = [f'ALTER DATABASE {db} PRIMARY REGION "us-east1"']
statements += [f'ALTER DATABASE {db} ADD REGION "{r}"' for r in CITIES if r != "us-east1"]
statements += ["ALTER TABLE promo_codes SET LOCALITY GLOBAL"]
statements += [f"ALTER TABLE {t} SET LOCALITY REGIONAL BY ROW" for t in ("users", "vehicles")]
for sql in statements:
    run_transaction(Session, lambda s, sql=sql: s.execute(text(sql)))
print("ok: region and locality DDL")
for table in ("users", "vehicles"):
    for region, cs in CITIES.items():
        run_transaction(
            Session,
            lambda s, t=table, r=region, c=cs: s.execute(
                text(f"UPDATE {t} SET crdb_region = :r WHERE city = ANY(:c)"), {"r": r, "c": c}
            ),
        )

# The reader's transaction went on (restarted under it, as CockroachDB would not block).
check("reader still works", reader.query(User).count(), 15)
reader.commit()

with engine.connect() as c:
    localities = dict(c.execute(text("SELECT table_name, locality FROM [SHOW TABLES]")).all())
    check(
        "localities",
        localities,
        {"promo_codes": "GLOBAL", "users": "REGIONAL BY ROW", "vehicles": "REGIONAL BY ROW"},
    )
    per_region = c.execute(
        text("SELECT crdb_region, count(*) FROM users GROUP BY 1 ORDER BY 1")
    ).all()
    check("users per region", [tuple(r) for r in per_region],
          [("europe-west1", 6), ("us-east1", 6), ("us-west1", 3)])

# run_transaction retries a serialization failure from the savepoint.
attempts = []


def flaky(session):
    attempts.append(1)
    if len(attempts) == 1:
        session.execute(text("SELECT multiregion.raise_error('40001', 'restart transaction')"))
    return session.execute(text("SELECT count(*) FROM vehicles")).scalar()


check("retried transaction result", run_transaction(Session, flaky), 15)
check("attempts", len(attempts), 2)

# UPSERT and the ORM's own writes after the conversion.
run_transaction(
    Session,
    lambda s: s.execute(
        text("UPSERT INTO promo_codes (code, description) VALUES ('welcome', '20% off')")
    ),
)
with engine.connect() as c:
    check("upserted", c.execute(text("SELECT description FROM promo_codes")).scalar(), "20% off")
run_transaction(Session, lambda s: s.add(User(id=str(uuid.uuid4()), city="rome", name="new")))
with engine.connect() as c:
    check("new user's region", c.execute(
        text("SELECT crdb_region FROM users WHERE name = 'new'")).scalar(), "us-east1")
print("movr_like: all checks passed")
