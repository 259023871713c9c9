package main

// The machine and the database the figures were measured on, for the
// report.

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// environment describes the machine and the database.
type environment struct {
	Date       string `json:"date"`
	Machine    string `json:"machine"`
	CPUs       int    `json:"cpus"`
	Go         string `json:"go"`
	Postgres   string `json:"postgres"`
	PGSettings string `json:"postgres_settings"`
}

func describeEnvironment(ctx context.Context, cfg config) (environment, error) {
	env := environment{
		Date:    time.Now().UTC().Format("2006-01-02 15:04 UTC"),
		Machine: runtime.GOOS + "/" + runtime.GOARCH,
		CPUs:    runtime.NumCPU(),
		Go:      runtime.Version(),
	}
	if model := cpuModel(); model != "" {
		env.Machine += ", " + model
	}
	conn, err := pgx.Connect(ctx, cfg.dsn)
	if err != nil {
		return env, fmt.Errorf("connecting to Postgres (%s): %w", cfg.dsn, err)
	}
	defer conn.Close(ctx)
	if err := conn.QueryRow(ctx, "SELECT split_part(version(), ' ', 2)").Scan(&env.Postgres); err != nil {
		return env, err
	}
	rows, err := conn.Query(ctx, `SELECT name || '=' || setting || coalesce(unit, '') FROM pg_settings
		WHERE name IN ('synchronous_commit', 'fsync', 'shared_buffers', 'max_connections') ORDER BY name`)
	if err != nil {
		return env, err
	}
	settings, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return env, err
	}
	env.PGSettings = strings.Join(settings, " ")
	return env, nil
}

func cpuModel() string {
	data, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "model name"); ok {
			return strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
		}
	}
	return ""
}
