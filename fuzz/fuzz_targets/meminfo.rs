//! /proc/meminfo's MemAvailable line.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = regrade::pressure::parse_mem_available(data);
});
