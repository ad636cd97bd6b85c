//! A k3s config file (regrade's drop-in or anyone's): the level it stands for, and its
//! top-level keys read as k3s reads them (YAML 1.1 scalars, appends, lists).
#![no_main]
use regrade::actuator::systemd::dropin;
use regrade::k3s_config::yaml;
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let levels = regrade::config::Config::default().levels;
        let _ = dropin::classify(text, &levels);
        if let Ok(pairs) = yaml::parse(text) {
            for (_, value) in pairs {
                let _ = value.items();
            }
        }
    }
});
