-- Leader leases for periodic jobs (the janitor's passes): one holder per job across all
-- replicas, taken and renewed with ordinary transactions, so they work behind a
-- transaction pooler (a session advisory lock would stay on a server connection the
-- pooler hands to someone else). `token` grows with every new holder: a holder whose
-- token is no longer the row's has been taken over and must stop (src/lease.rs).
CREATE TABLE leases (
    name text PRIMARY KEY,
    holder text NOT NULL,
    token bigint NOT NULL,
    expires_at timestamptz NOT NULL
);
