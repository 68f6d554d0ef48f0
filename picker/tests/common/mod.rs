//! Shared by the picker's integration tests.

use std::sync::atomic::{AtomicU32, Ordering};

/// Ports handed to servers another process binds later (Envoy, the picker binary): 15000–19999,
/// below Linux's ephemeral range (32768–60999), from which the kernel picks the local port of every
/// outgoing connection. A port from `bind(0)` is in that range, so between the test picking it and
/// the child binding it any client connection could take it (the harness lost an engine that way,
/// tests/harness/src/paths.rs).
const PORTS: std::ops::Range<u32> = 15_000..20_000;

/// A port of [`PORTS`] that was free a moment ago, in turn from a start that differs per process
/// (test binaries may run side by side).
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let span = PORTS.end - PORTS.start;
    let seed = std::process::id().wrapping_mul(2_654_435_761) % span;
    let _ = NEXT.compare_exchange(u32::MAX, seed, Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..span {
        let port = PORTS.start + NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let Ok(port) = u16::try_from(port) else { continue };
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    // Everything taken: fall back to the kernel's choice.
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(0)
}
