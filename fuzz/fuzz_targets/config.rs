//! The TOML configuration file: parse and validate.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = regrade::config::Config::parse(text);
    }
});
