//! One k3s config file, read as k3s reads it: k3s unmarshals the file with Go's
//! gopkg.in/yaml.v2 into an ordered map (`yaml.MapSlice`) and turns each value into
//! text. yaml.v2 speaks YAML 1.1, where a plain `yes`, `on` or `y` is a boolean, `~` or
//! nothing is null and `0x1F` an integer; saphyr-parser speaks YAML 1.2 but hands each
//! scalar over with its style, so the 1.1 reading of plain scalars is done here.
//! Quoted scalars are strings as written. Only the first document is read (as
//! `yaml.Unmarshal` does). A float stays as written (yaml.v2 would print `1.50` as
//! `1.5`; no k3s flag regrade reads is a float).

use std::collections::HashMap;

use saphyr_parser::{Event, Parser, ScalarStyle};

/// A value of a top-level key, as k3s turns it into text.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A string scalar: quoted, or plain and of no other type.
    Str(String),
    /// A plain scalar of another type (boolean, integer, null), as Go prints it; null
    /// is the empty text.
    Other(String),
    /// A sequence of scalars, each as text.
    List(Vec<String>),
}

impl Value {
    /// The items an append (`key+`) adds or extends: k3s's `toSlice`. An empty
    /// non-string scalar (null) adds nothing.
    pub fn items(&self) -> Vec<String> {
        match self {
            Value::Str(s) => vec![s.clone()],
            Value::Other(s) if s.trim().is_empty() => Vec::new(),
            Value::Other(s) => vec![s.trim().to_string()],
            Value::List(items) => items.clone(),
        }
    }
}

/// The file's top-level keys with their values, in the file's order (a key written
/// twice is there twice, as in yaml.v2's MapSlice).
pub fn parse(text: &str) -> Result<Vec<(String, Value)>, String> {
    let mut events = Parser::new_from_str(text).map(|r| r.map(|(e, span)| (e, span.start.line())));
    let mut next = move || -> Result<(Event<'_>, usize), String> {
        match events.next() {
            Some(Ok(e)) => Ok(e),
            Some(Err(e)) => Err(e.to_string()),
            None => Ok((Event::StreamEnd, 0)),
        }
    };
    let mut anchors: HashMap<usize, Value> = HashMap::new();
    // StreamStart, then the first document, if any.
    loop {
        match next()?.0 {
            Event::StreamStart | Event::DocumentStart(_) => continue,
            Event::StreamEnd => return Ok(Vec::new()),
            Event::MappingStart(..) => break,
            Event::Scalar(s, style, ..) if matches!(resolve(&s, style, false), Value::Other(ref n) if n.is_empty()) => {
                return Ok(Vec::new())
            }
            _ => return Err("the file is not a mapping of flag names to values".into()),
        }
    }
    let mut out = Vec::new();
    loop {
        let (key, line) = match next()? {
            (Event::MappingEnd, _) => return Ok(out),
            (Event::Scalar(s, style, ..), line) => (text_of(&resolve(&s, style, false)), line),
            (_, line) => return Err(format!("line {line}: a key that is not a plain name")),
        };
        let value = match next()?.0 {
            Event::Scalar(s, style, anchor, tag) => {
                let v = resolve(&s, style, tag.is_some_and(|t| t.suffix == "str"));
                if anchor > 0 {
                    anchors.insert(anchor, v.clone());
                }
                v
            }
            Event::Alias(id) => anchors.get(&id).cloned().ok_or(format!("line {line}: an unknown alias"))?,
            Event::SequenceStart(anchor, _) => {
                let mut items = Vec::new();
                loop {
                    match next()?.0 {
                        Event::SequenceEnd => break,
                        Event::Scalar(s, style, _, tag) => {
                            items.push(text_of(&resolve(&s, style, tag.is_some_and(|t| t.suffix == "str"))))
                        }
                        Event::Alias(id) => match anchors.get(&id) {
                            Some(v @ (Value::Str(_) | Value::Other(_))) => items.push(text_of(v)),
                            _ => return Err(format!("line {line}: {key}: an alias of a list inside a list")),
                        },
                        _ => return Err(format!("line {line}: {key}: a list or mapping inside a list")),
                    }
                }
                let v = Value::List(items);
                if anchor > 0 {
                    anchors.insert(anchor, v.clone());
                }
                v
            }
            _ => return Err(format!("line {line}: {key}: a mapping is no flag value")),
        };
        out.push((key, value));
    }
}

/// The text k3s passes for a scalar.
fn text_of(v: &Value) -> String {
    match v {
        Value::Str(s) | Value::Other(s) => s.clone(),
        Value::List(items) => items.join(","),
    }
}

/// A scalar as yaml.v2 resolves it: only a plain one (not quoted, not `!!str`) can be
/// other than a string.
fn resolve(s: &str, style: ScalarStyle, tagged_str: bool) -> Value {
    if style != ScalarStyle::Plain || tagged_str {
        return Value::Str(s.to_string());
    }
    match s {
        "" | "~" | "null" | "Null" | "NULL" => Value::Other(String::new()),
        "y" | "Y" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" | "true" | "True" | "TRUE" => {
            Value::Other("true".into())
        }
        "n" | "N" | "no" | "No" | "NO" | "off" | "Off" | "OFF" | "false" | "False" | "FALSE" => {
            Value::Other("false".into())
        }
        _ => integer(s).map_or_else(|| Value::Str(s.to_string()), |i| Value::Other(i.to_string())),
    }
}

/// A YAML 1.1 integer as yaml.v2 reads it (Go's `ParseInt(s, 0, 64)` with `_` taken
/// out): decimal, `0x` hexadecimal, `0o` or a leading `0` octal, `0b` binary.
fn integer(s: &str) -> Option<i128> {
    let plain: String = s.chars().filter(|&c| c != '_').collect();
    let (negative, digits) = match plain.as_bytes().first()? {
        b'-' => (true, &plain[1..]),
        b'+' => (false, &plain[1..]),
        _ => (false, plain.as_str()),
    };
    let (radix, digits) = if let Some(d) = digits.strip_prefix("0x").or(digits.strip_prefix("0X")) {
        (16, d)
    } else if let Some(d) = digits.strip_prefix("0o").or(digits.strip_prefix("0O")) {
        (8, d)
    } else if let Some(d) = digits.strip_prefix("0b").or(digits.strip_prefix("0B")) {
        (2, d)
    } else if digits.len() > 1 && digits.starts_with('0') {
        (8, &digits[1..])
    } else {
        (10, digits)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let n = i128::from_str_radix(digits, radix).ok()?;
    let n = if negative { -n } else { n };
    (i128::from(i64::MIN)..=i128::from(u64::MAX)).contains(&n).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(text: &str) -> Value {
        let mut entries = parse(text).unwrap();
        assert_eq!(entries.len(), 1, "{entries:?}");
        entries.remove(0).1
    }

    #[test]
    fn plain_scalars_are_read_as_yaml_1_1_and_quoted_ones_as_written() {
        for (yes, text) in [("yes", "true"), ("On", "true"), ("y", "true"), ("NO", "false"), ("off", "false")] {
            assert_eq!(one(&format!("k: {yes}\n")), Value::Other(text.into()), "{yes}");
            assert_eq!(one(&format!("k: \"{yes}\"\n")), Value::Str(yes.into()), "{yes}");
        }
        assert_eq!(one("k:\n"), Value::Other(String::new()));
        assert_eq!(one("k: ~\n"), Value::Other(String::new()));
        assert_eq!(one("k: 0x1F\n"), Value::Other("31".into()));
        assert_eq!(one("k: 0755\n"), Value::Other("493".into()));
        assert_eq!(one("k: 1_000\n"), Value::Other("1000".into()));
        assert_eq!(one("k: !!str yes\n"), Value::Str("yes".into()));
        assert_eq!(one("k: 1.5\n"), Value::Str("1.5".into()));
        assert_eq!(one("k: memory=1Gi\n"), Value::Str("memory=1Gi".into()));
    }

    #[test]
    fn lists_are_read_in_block_and_flow_style_with_anchors() {
        assert_eq!(one("k: [max-pods=50, \"a,b\"]\n"), Value::List(vec!["max-pods=50".into(), "a,b".into()]));
        assert_eq!(one("k:\n- 1\n- \"\"\n- yes\n"), Value::List(vec!["1".into(), "".into(), "true".into()]));
        let entries = parse("a: &x [p=1]\nb: *x\nc: &s one\nd: [*s]\n").unwrap();
        assert_eq!(entries[1].1, Value::List(vec!["p=1".into()]));
        assert_eq!(entries[3].1, Value::List(vec!["one".into()]));
    }

    #[test]
    fn only_a_flat_mapping_is_a_config_file() {
        assert_eq!(parse("").unwrap(), []);
        assert_eq!(parse("# only a comment\n").unwrap(), []);
        assert_eq!(parse("a: 1\n---\nb: 2\n").unwrap().len(), 1, "the first document only");
        let dup = parse("a: 1\na: 2\n").unwrap();
        assert_eq!(dup.len(), 2, "a key twice is read twice, the later last");
        assert!(parse("- a\n").is_err());
        assert!(parse("a:\n  b: c\n").unwrap_err().contains("a: a mapping"));
        assert!(parse("a: [b\n").is_err());
    }
}
