//! Pool tests: registration, snapshots/deltas, grace expiry, queue depth.
