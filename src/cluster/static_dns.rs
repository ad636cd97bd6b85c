//! Host names in a statically linked regrade (the build the Docker images carry).
//!
//! A static glibc loads no NSS modules: it resolves host names only through the
//! `files` (/etc/hosts) and `dns` sources built into it, in the order
//! /etc/nsswitch.conf gives (without that file glibc asks DNS first and reads
//! /etc/hosts only when DNS is unavailable; the regrade image ships `hosts: files
//! dns`). musl behaves the same way. So a kubeconfig server or `cluster.api_servers`
//! name that the host resolves through systemd-resolved, mDNS, LDAP or `myhostname`
//! does not resolve here, and the lookup error alone does not say why.

/// Whether this binary is statically linked (`-C target-feature=+crt-static`).
pub const STATIC_BUILD: bool = cfg!(target_feature = "crt-static");

/// `why` an endpoint was passed over, with the reason a static build could not look
/// its host up, naming the host and the way out. Unchanged for any other failure, and
/// in a dynamically linked build (its resolver is the system's).
pub fn explain_lookup_failure(url: &str, why: String, static_build: bool) -> String {
    if !static_build || !(why.contains("dns error") || why.contains("failed to lookup address")) {
        return why;
    }
    let host = host_of(url);
    format!(
        "{why} (this regrade is statically linked: it resolves the host name {host} only from /etc/hosts \
         and DNS, with no other NSS module; add {host} to /etc/hosts or put its IP address in the URL)"
    )
}

/// The host part of `scheme://[user@]host[:port][/path]`.
fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if let Some(v6) = hostport.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    hostport.rsplit_once(':').map_or(hostport, |(h, _)| h)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOOKUP: &str =
        "client error (Connect): dns error: failed to lookup address information: Name or service not known";

    #[test]
    fn a_failed_lookup_in_a_static_build_names_the_host_and_the_way_out() {
        let s = explain_lookup_failure("https://server-2.example:6443", LOOKUP.into(), true);
        assert!(s.starts_with(LOOKUP), "{s}");
        assert!(
            s.contains("statically linked") && s.contains("host name server-2.example only from /etc/hosts"),
            "{s}"
        );
        assert!(s.contains("add server-2.example to /etc/hosts"), "{s}");
    }

    #[test]
    fn other_failures_and_dynamic_builds_are_left_alone() {
        assert_eq!(explain_lookup_failure("https://a:6443", LOOKUP.into(), false), LOOKUP);
        let refused = "client error (Connect): tcp connect error: Connection refused (os error 111)";
        assert_eq!(explain_lookup_failure("https://10.0.0.1:6443", refused.into(), true), refused);
    }

    #[test]
    fn the_host_of_a_url() {
        assert_eq!(host_of("https://server-2.example:6443"), "server-2.example");
        assert_eq!(host_of("https://u@k3s.lan/path"), "k3s.lan");
        assert_eq!(host_of("https://[fd00::1]:6443"), "fd00::1");
        assert_eq!(host_of("k3s"), "k3s");
    }
}
