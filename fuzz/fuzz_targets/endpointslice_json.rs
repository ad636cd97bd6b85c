//! The default/kubernetes EndpointSlice regrade discovers API servers from.
#![no_main]
use k8s_openapi::api::discovery::v1::EndpointSlice;
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(s) = serde_json::from_slice::<EndpointSlice>(data) {
        for url in regrade::cluster::endpoints::urls_of(&s) {
            // Every URL is https://<IP literal>:<port>, nothing else.
            let rest = url.strip_prefix("https://").expect("https");
            let (host, port) = rest.rsplit_once(':').expect("a port");
            assert!(port.parse::<u16>().is_ok_and(|p| p != 0), "{url}");
            let host = host.trim_start_matches('[').trim_end_matches(']');
            assert!(host.parse::<std::net::IpAddr>().is_ok(), "{url}");
        }
    }
});
