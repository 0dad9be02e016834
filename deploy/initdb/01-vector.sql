-- Run once by the postgres image on an empty data folder (/docker-entrypoint-initdb.d/).
-- rmm's first migration also runs this, but only a role allowed to create extensions may: creating
-- it here as the superuser lets rmm connect as an ordinary owner of its database.
CREATE EXTENSION IF NOT EXISTS vector SCHEMA public;  -- public: every bank schema resolves it
