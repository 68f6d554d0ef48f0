#![no_main]
// The `ext_proc_body` target: see tests/fuzz-targets/src/lib.rs.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_targets::ext_proc_body(data));
