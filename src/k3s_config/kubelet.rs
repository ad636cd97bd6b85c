//! What the kubelet makes of k3s's `kubelet-arg` values. k3s passes each as
//! `--name=value`, repeated names kept in order (`pkg/util/args.go`, `GetArgs`; a
//! trailing `+` or `-` on the name only places the value before or after k3s's own
//! default, and k3s sets no `system-reserved` of its own). A map flag of the kubelet
//! such as `--system-reserved` (`MapStringString`) reads every occurrence, splits
//! each at commas into `key=value` pairs, and keeps the last value per key.

use std::collections::BTreeMap;

use super::{Effective, Source};

/// One key of a map flag as the kubelet ends with it.
#[derive(Debug, Clone, PartialEq)]
pub struct MapEntry {
    pub value: String,
    pub from: Source,
}

/// A value the kubelet dropped for a later one of the same key.
#[derive(Debug, Clone, PartialEq)]
pub struct Replaced {
    pub key: String,
    pub value: String,
    pub from: Source,
    pub by: MapEntry,
}

/// A kubelet map flag (`system-reserved`, `kube-reserved`, `eviction-hard`...) as the
/// kubelet ends with it from k3s's `kubelet-arg`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MapFlag {
    pub entries: BTreeMap<String, MapEntry>,
    /// Values an occurrence later in the arguments replaced.
    pub replaced: Vec<Replaced>,
}

/// The kubelet's map flag `name` from `eff`'s `kubelet-arg` values.
pub fn map_flag(eff: &Effective, name: &str) -> MapFlag {
    let mut flag = MapFlag::default();
    for arg in eff.all("kubelet-arg") {
        for (k, v) in pairs_of(&arg.value, name).unwrap_or_default() {
            let entry = MapEntry { value: v, from: arg.from.clone() };
            if let Some(old) = flag.entries.insert(k.clone(), entry.clone()) {
                flag.replaced.push(Replaced { key: k, value: old.value, from: old.from, by: entry });
            }
        }
    }
    flag
}

/// The `key=value` pairs one `kubelet-arg` value gives the kubelet's map flag `name`
/// (`system-reserved=memory=1Gi,cpu=1`); `None` when it is another flag.
pub fn pairs_of(kubelet_arg: &str, name: &str) -> Option<Vec<(String, String)>> {
    let (flag_name, value) = kubelet_arg.trim_start_matches('-').split_once('=').unwrap_or((kubelet_arg, ""));
    if flag_name.trim_end_matches(['+', '-']) != name {
        return None;
    }
    let pairs = value.split(',').filter_map(|p| p.split_once('=')).map(|(k, v)| (k.trim().into(), v.trim().into()));
    Some(pairs.collect())
}

/// A Kubernetes memory quantity in bytes (`768Mi`, `2Gi`, `1G`, `512000k`, plain
/// bytes); `None` for anything else.
pub fn quantity_bytes(q: &str) -> Option<u128> {
    let q = q.trim();
    let split = q.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let factor: u128 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        _ => return None,
    };
    match number.split_once('.') {
        None => number.parse::<u128>().ok().map(|n| n * factor),
        Some((whole, frac)) => {
            let scale = 10u128.checked_pow(frac.len() as u32)?;
            let n: u128 = format!("{whole}{frac}").parse().ok()?;
            Some(n * factor / scale)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k3s_config::Arg;

    fn eff(values: &[(&str, &str)]) -> Effective {
        let args = values
            .iter()
            .map(|(v, f)| Arg { key: "kubelet-arg".into(), value: v.to_string(), from: Source::File(f.into()) })
            .collect();
        Effective { args, ..Default::default() }
    }

    #[test]
    fn the_last_value_per_key_wins_and_other_keys_are_kept() {
        let e = eff(&[
            ("system-reserved=memory=2Gi,cpu=500m", "config.yaml"),
            ("max-pods=50", "90-site.yaml"),
            ("system-reserved=memory=768Mi", "40-regrade-reserved.yaml"),
        ]);
        let f = map_flag(&e, "system-reserved");
        assert_eq!(f.entries["memory"].value, "768Mi");
        assert_eq!(f.entries["memory"].from, Source::File("40-regrade-reserved.yaml".into()));
        assert_eq!(f.entries["cpu"].value, "500m", "a key given once stays");
        assert_eq!(f.replaced.len(), 1);
        assert_eq!((f.replaced[0].value.as_str(), &f.replaced[0].from), ("2Gi", &Source::File("config.yaml".into())));
        assert!(map_flag(&e, "kube-reserved").entries.is_empty());
    }

    #[test]
    fn quantities_are_read_in_bytes() {
        assert_eq!(quantity_bytes("768Mi"), Some(768 << 20));
        assert_eq!(quantity_bytes("2Gi"), Some(2 << 30));
        assert_eq!(quantity_bytes("1.5Gi"), Some(3 << 29));
        assert_eq!(quantity_bytes("1G"), Some(1_000_000_000));
        assert_eq!(quantity_bytes("1024"), Some(1024));
        assert_eq!(quantity_bytes("lots"), None);
    }
}
