package idempotency

// A failover keeps every record only if each commit had reached the
// standby that is promoted. This file warns, at start, about a primary
// whose commits do not wait for its standbys.

import (
	"context"
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

// warnAsyncReplication logs one warning when the primary that pool
// reaches has standbys that its commits do not wait for. It runs in the
// background: a store may start while its database is down, and the
// check is advice, so an error (no privilege, no server) is only logged
// at debug level.
func warnAsyncReplication(ctx context.Context, pool *pgxpool.Pool, logger *zap.Logger) {
	go func() {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		var commit, names, async string
		var known, unknown int
		err := pool.QueryRow(ctx, replicationQuery).Scan(&commit, &names, &async, &known, &unknown)
		if err != nil {
			logger.Debug("could not check the database's replication", zap.Error(err))
			return
		}
		var why string
		switch {
		case known+unknown == 0:
			return // no standby, or one this check cannot see (a managed service's storage replication)
		case async != "":
			why = "standbys replicate asynchronously"
		case names == "":
			// The senders' details are hidden, but with no synchronous
			// standby named, every standby is asynchronous.
			why = "standbys replicate asynchronously"
		case commit == "off" || commit == "local":
			why = "synchronous_commit is " + commit + ": commits do not wait for the synchronous standby"
		default:
			return
		}
		logger.Warn("a failover of this database can lose records: "+why+", so an acquire or a completion "+
			"committed on the primary but not yet replicated is missing on the promoted standby, and its key "+
			"executes again; set synchronous_standby_names and synchronous_commit = on (README, High availability)",
			zap.String("async_standbys", async),
			zap.String("synchronous_standby_names", names),
			zap.String("synchronous_commit", commit))
	}()
}
