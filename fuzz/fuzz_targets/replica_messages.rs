#![no_main]
// The `replica_messages` target: see tests/fuzz-targets/src/lib.rs.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_targets::replica_messages(data));
