-- The server's shared state, version 5: one reflection job per session, enforced by the database.
-- Concurrent `sessions/end` requests (or a whole session posted twice) could each insert a job for
-- the same session, so it was reflected into memories more than once. A unique index over the
-- user and the session id the payload names makes a second insert conflict; the server then
-- answers the job already there. Cancelled jobs (their user was deleted) do not count.
--
-- Duplicates an older rmm left behind are cancelled first, keeping the oldest job of each session.
UPDATE jobs SET status = 'cancelled',
                finished_at = coalesce(finished_at, extract(epoch FROM clock_timestamp())),
                error = coalesce(error, 'duplicate of job ' || d.first_id || ' (one session, one job)')
FROM (
    SELECT id, first_value(id) OVER (PARTITION BY user_id, payload -> 'session' ->> 'id'
                                     ORDER BY created_at, id) AS first_id
    FROM jobs
    WHERE kind = 'reflect' AND status <> 'cancelled'
) AS d
WHERE jobs.id = d.id AND d.id <> d.first_id;

CREATE UNIQUE INDEX jobs_one_per_session ON jobs (user_id, (payload -> 'session' ->> 'id'))
    WHERE kind = 'reflect' AND status <> 'cancelled';
