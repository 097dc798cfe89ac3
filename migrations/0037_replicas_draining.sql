-- When a replica began its drain (a clean stop's first step, --shutdown-drain-secs: still
-- serving while /readyz answers 503): the roster shows it draining until it stops. A new
-- nullable column only (expand): the release before it neither writes nor reads it.
ALTER TABLE replicas ADD COLUMN draining_since timestamptz;
