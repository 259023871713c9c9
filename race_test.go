//go:build race

package idempotency

// raceEnabled: the race detector drops sync.Pool items at random, so a
// pooled buffer is sometimes allocated anew and allocation counts wobble.
const raceEnabled = true
