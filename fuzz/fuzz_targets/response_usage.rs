#![no_main]
// The `response_usage` target: see tests/fuzz-targets/src/lib.rs.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_targets::response_usage(data));
