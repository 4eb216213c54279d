-- Requests to resign (Election.RequestResign) are recorded in the leader's
-- row as well as notified, so a leader whose listener connection was away
-- when the notification was sent still finds the request.
ALTER TABLE leaders ADD COLUMN resign_term bigint;

COMMENT ON COLUMN leaders.resign_term IS
    'A term whose leader was asked to step down (Election.RequestResign): the leader of that term resigns when it reads it. NULL, or an older term, when no request is pending.';
