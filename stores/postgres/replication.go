package postgres

// A failover keeps every record only if each commit had reached the
// standby that is promoted. This file warns, at start, about a primary
// whose commits do not wait for its standbys.

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// replicationQuery reads, in one round trip, what decides whether a
// commit waits for the standbys: the session's synchronous_commit (a role
// or database may set it), synchronous_standby_names, and the physical
// standbys streaming now by their sync_state. Logical replication's
// senders (they have a database) and base backups are no failover
// targets. Without pg_read_all_stats, pg_stat_replication shows a
// sender's pid only: such rows count as unknown.
const replicationQuery = `SELECT current_setting('synchronous_commit'),
	current_setting('synchronous_standby_names'),
	coalesce(string_agg(r.application_name, ', ') FILTER (WHERE r.sync_state IN ('async', 'potential')), ''),
	count(*) FILTER (WHERE r.sync_state IS NOT NULL),
	count(*) FILTER (WHERE r.sync_state IS NULL)
FROM pg_stat_replication r JOIN pg_stat_activity a ON a.pid = r.pid
WHERE a.datid IS NULL AND r.state IS DISTINCT FROM 'backup'`

// replicationChecked holds the pools whose replication was checked:
// the stores of several sites, and config reloads, share a pool, and one
// warning per database is enough. (A pool stays in it once closed: a
// pointer per dsn ever configured.)
var replicationChecked sync.Map

// warnAsyncReplication logs one warning when the primary that pool
// reaches has standbys that its commits do not wait for. It runs in the
// background: a store may start while its database is down, and the
// check is advice, so an error (no privilege, no server) is only logged
// at debug level.
func warnAsyncReplication(ctx context.Context, pool *pgxpool.Pool, logger *zap.Logger) {
	if _, checked := replicationChecked.LoadOrStore(pool, true); checked {
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		r, err := checkReplication(ctx, pool)
		switch {
		case err != nil:
			logger.Debug("could not check the database's replication", zap.Error(err))
		case r.risk != "":
			logger.Warn("a failover of this database can lose records: "+r.risk+", so an acquire or a completion "+
				"committed on the primary but not yet replicated is missing on the promoted standby, and its key "+
				"executes again; set synchronous_standby_names and synchronous_commit = on (docs/high-availability.md)",
				zap.String("async_standbys", r.asyncStandbys),
				zap.String("synchronous_standby_names", r.standbyNames),
				zap.String("synchronous_commit", r.commit))
		}
	}()
}

// replication is what checkReplication found; risk is "" when a
// failover to a standby loses nothing that was committed (or when there
// is no standby this check can see, such as a managed service's storage
// replication).
type replication struct {
	commit, standbyNames, asyncStandbys string
	risk                                string
}

func checkReplication(ctx context.Context, pool *pgxpool.Pool) (replication, error) {
	var r replication
	var known, unknown int
	err := pool.QueryRow(ctx, replicationQuery, unnamed).Scan(&r.commit, &r.standbyNames, &r.asyncStandbys, &known, &unknown)
	if err != nil {
		return r, err
	}
	switch {
	case known+unknown == 0:
	case r.asyncStandbys != "":
		r.risk = "standbys replicate asynchronously"
	case r.standbyNames == "":
		// The senders' details are hidden, but with no synchronous
		// standby named, every standby is asynchronous.
		r.risk = "standbys replicate asynchronously"
	case r.commit == "off" || r.commit == "local":
		r.risk = "synchronous_commit is " + r.commit + ": commits do not wait for the synchronous standby"
	}
	return r, nil
}
