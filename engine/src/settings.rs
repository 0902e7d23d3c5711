//! Declared settings: the `settings_group!` macro and what it builds on. Owns how one setting
//! is named (`[group] field` in TOML, `KVTIDE_<GROUP>_<FIELD>` as a variable), read from text
//! (sizes, booleans, counts, paths) and found (unknown names are errors that name the closest
//! valid one). Never holds a setting's value or default: the groups do (`StoreBuilder`'s in
//! this crate, the owner's in `kvtide-remote`), each field declared once.

use std::path::PathBuf;

/// How a setting's text is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A byte size: `4096`, `"64KiB"`, `"8 GiB"`, `"1.5GB"` (binary units).
    Bytes,
    /// A whole number (counts; durations, whose unit ends the name: `*_ms`, `*_us`).
    Count,
    /// `true`/`false`, `1`/`0`, `on`/`off`, `yes`/`no`.
    Bool,
    /// A decimal number (fractions).
    Fraction,
    /// Free text (names, addresses; "off" where a field says so).
    Text,
    /// A filesystem path.
    Path,
}

/// One declared setting.
#[derive(Clone, Copy, Debug)]
pub struct Field {
    /// Its name inside its group (`bytes` of `[dram]`).
    pub name: &'static str,
    pub kind: Kind,
    /// True when leaving it out means "derive it" (the field is an `Option`).
    pub optional: bool,
    /// Its documentation.
    pub doc: &'static str,
    /// A valid value that differs from the default (tests set every field to it).
    pub example: &'static str,
}

/// A group of settings, as `settings_group!` declares it.
pub trait SettingGroup: Default + std::fmt::Debug {
    /// Its TOML section and the middle of its variables' names.
    const NAME: &'static str;
    /// Its fields, in declaration order.
    const FIELDS: &'static [Field];
    /// Sets `field` from `text`; `Ok(false)` when there is no such field.
    fn set(&mut self, field: &str, text: &str) -> Result<bool, String>;
    /// `field`'s current value, as `{:?}` writes it.
    fn show(&self, field: &str) -> Option<String>;
}

/// Several groups behind one name space (`StoreBuilder`: the engine's; the owner's settings:
/// the engine's plus its own).
pub trait Settings {
    /// Every group: its name and fields.
    fn groups(&self) -> Vec<(&'static str, &'static [Field])>;
    /// Sets `group.field` from `text`; `Ok(false)` when there is no such setting.
    fn set(&mut self, group: &str, field: &str, text: &str) -> Result<bool, String>;
    /// `group.field`'s current value, as `{:?}` writes it.
    fn show(&self, group: &str, field: &str) -> Option<String>;
}

/// The variable of `group.field`: `KVTIDE_<GROUP>_<FIELD>`, upper-cased.
pub fn variable_name(group: &str, field: &str) -> String {
    format!("KVTIDE_{}_{}", group.to_ascii_uppercase(), field.to_ascii_uppercase())
}

/// `KVTIDE_*` variables that are not settings: read by tools, clients and tests, never refused.
/// Exact names, or prefixes where they end in `_`.
pub const NON_SETTING_VARIABLES: &[(&str, &str)] = &[
    ("KVTIDE_LOG", "log filter of kvtide-owner and the benchmarks"),
    ("KVTIDE_DATA_DIR", "kvtide-owner's data directory when [owner] data_dir is not set"),
    ("KVTIDE_TOKEN_FILE", "token file RemoteStore::connect authenticates with"),
    ("KVTIDE_TIMEOUT_MS", "RemoteStore::connect's request deadline"),
    ("KVTIDE_SHARED_MEMORY", "whether RemoteStore::connect maps the owner's arena"),
    ("KVTIDE_READ_INDEX", "whether RemoteStore::connect reads through the owner's read index"),
    ("KVTIDE_DIRECT_PUTS", "whether RemoteStore::connect lets a same-user owner read put values from its memory"),
    ("KVTIDE_ADDRESS", "the owner the SGLang and vLLM adapters connect to"),
    ("KVTIDE_CUDA_PROFILE", "GPU timelines of staged transfers (benchmarks)"),
    ("KVTIDE_FUZZ_RUNS", "runs per fuzz target in CI"),
    ("KVTIDE_WRITE_FUZZ_SEEDS", "regenerates the protocol fuzz seeds (ignored test)"),
    ("KVTIDE_RECOVERY_GIB", "size of the recovery-time test (ignored test)"),
    ("KVTIDE_ARENA_CHILD", "child process of a remote test"),
    ("KVTIDE_REMOTE_CHILD_SOCKET", "child process of a remote test"),
    ("KVTIDE_SIM_", "simulator test seeds, keys and traces"),
    ("KVTIDE_CRASH_", "crash test rounds and child processes"),
    ("KVTIDE_DURABILITY_", "durability test child processes"),
    ("KVTIDE_OWNER_", "kvtide-owner's own settings ([owner]), checked by kvtide-owner"),
];

/// True when `name` is on `NON_SETTING_VARIABLES`.
pub fn is_non_setting_variable(name: &str) -> bool {
    NON_SETTING_VARIABLES
        .iter()
        .any(|(known, _)| if known.ends_with('_') { name.starts_with(known) } else { name == *known })
}

/// A value of a setting field, read from text of its kind.
pub trait SettingValue: Sized {
    /// True for `Option`s: leaving the setting out means "derive it".
    const OPTIONAL: bool = false;
    fn parse_setting(kind: Kind, text: &str) -> Result<Self, String>;
}

fn number<T: TryFrom<u64>>(kind: Kind, text: &str) -> Result<T, String> {
    let text = text.trim();
    let n = match kind {
        Kind::Bytes => {
            parse_bytes(text).ok_or_else(|| format!("{text:?} is not a size (e.g. 4096, \"64KiB\", \"4GiB\")"))?
        }
        _ => text.parse::<u64>().map_err(|_| format!("{text:?} is not a whole number"))?,
    };
    T::try_from(n).map_err(|_| format!("{text:?} is too large"))
}

impl SettingValue for u64 {
    fn parse_setting(kind: Kind, text: &str) -> Result<Self, String> {
        number(kind, text)
    }
}

impl SettingValue for u32 {
    fn parse_setting(kind: Kind, text: &str) -> Result<Self, String> {
        number(kind, text)
    }
}

impl SettingValue for usize {
    fn parse_setting(kind: Kind, text: &str) -> Result<Self, String> {
        number(kind, text)
    }
}

impl SettingValue for f64 {
    fn parse_setting(_: Kind, text: &str) -> Result<Self, String> {
        text.trim().parse::<f64>().ok().filter(|v| v.is_finite()).ok_or_else(|| format!("{text:?} is not a number"))
    }
}

impl SettingValue for bool {
    fn parse_setting(_: Kind, text: &str) -> Result<Self, String> {
        parse_bool(text.trim()).ok_or_else(|| format!("{text:?} is not a boolean (true/false, 1/0, on/off)"))
    }
}

impl SettingValue for String {
    fn parse_setting(_: Kind, text: &str) -> Result<Self, String> {
        Ok(text.to_string())
    }
}

impl SettingValue for PathBuf {
    fn parse_setting(_: Kind, text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Err("an empty path".into());
        }
        Ok(PathBuf::from(text))
    }
}

impl<T: SettingValue> SettingValue for Option<T> {
    const OPTIONAL: bool = true;
    fn parse_setting(kind: Kind, text: &str) -> Result<Self, String> {
        T::parse_setting(kind, text).map(Some)
    }
}

/// Parses "123", "64KiB", "8 GiB", "1.5GB", "512M" into bytes (binary units for K/M/G/T).
pub fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().ok()?;
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    let bytes = number * multiplier as f64;
    (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
}

/// Parses true/false, 1/0, on/off, yes/no (any case).
pub fn parse_bool(text: &str) -> Option<bool> {
    match text.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Levenshtein distance (for suggestions).
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != *cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// The candidate closest to `wrong`: one that ends with `wrong`'s tail (a setting named without
/// its group, or in the wrong group) first, else the smallest edit distance.
pub fn closest<'a>(wrong: &str, tail: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let candidates: Vec<&str> = candidates.into_iter().collect();
    let by_tail = candidates
        .iter()
        .copied()
        .filter(|c| !tail.is_empty() && c.ends_with(tail) && c.len() > tail.len())
        .min_by_key(|c| distance(wrong, c));
    by_tail.or_else(|| candidates.iter().copied().min_by_key(|c| distance(wrong, c)))
}

/// Every setting's variable name, with its group and field.
fn variables(settings: &dyn Settings) -> Vec<(String, &'static str, &'static str)> {
    let mut all = Vec::new();
    for (group, fields) in settings.groups() {
        for field in fields {
            all.push((variable_name(group, field.name), group, field.name));
        }
    }
    all
}

/// Applies `KVTIDE_*` variables to `settings`; returns the `group.field`s they set. A variable
/// of one of `settings`' groups that names no field, or any other `KVTIDE_*` variable that is
/// neither a setting nor on `NON_SETTING_VARIABLES`, is an error naming the closest setting.
pub fn apply_variables(
    settings: &mut dyn Settings,
    vars: impl IntoIterator<Item = (String, String)>,
) -> Result<Vec<(&'static str, &'static str)>, String> {
    let known = variables(settings);
    let group_prefixes: Vec<String> =
        settings.groups().iter().map(|(g, _)| format!("KVTIDE_{}_", g.to_ascii_uppercase())).collect();
    let mut set = Vec::new();
    for (name, value) in vars {
        if !name.starts_with("KVTIDE_") {
            continue;
        }
        if let Some((_, group, field)) = known.iter().find(|(v, _, _)| *v == name) {
            settings.set(group, field, value.trim()).map_err(|why| format!("{name}={value:?}: {why}"))?;
            set.push((*group, *field));
            continue;
        }
        let of_our_group = group_prefixes.iter().any(|p| name.starts_with(p.as_str()));
        if !of_our_group && is_non_setting_variable(&name) {
            continue;
        }
        let tail = &name["KVTIDE".len()..];
        let tail = group_prefixes.iter().find_map(|p| name.strip_prefix(&p[..p.len() - 1])).unwrap_or(tail);
        let mut message = format!("unknown variable {name}");
        if let Some(best) = closest(&name, tail, known.iter().map(|(v, _, _)| v.as_str())) {
            message.push_str(&format!("; did you mean {best}?"));
        }
        return Err(message);
    }
    Ok(set)
}

/// Applies a TOML document (`[group]` sections of `field = value`) to `settings`; returns the
/// `group.field`s it set. An unknown section or key is an error naming the closest valid one.
pub fn apply_toml(settings: &mut dyn Settings, text: &str) -> Result<Vec<(&'static str, &'static str)>, String> {
    let table: toml::Table = text.parse().map_err(|e| format!("TOML: {e}"))?;
    let groups = settings.groups();
    let mut set = Vec::new();
    for (section, body) in &table {
        let Some((group, fields)) = groups.iter().find(|(g, _)| *g == section.as_str()) else {
            let mut message = match body {
                toml::Value::Table(_) => format!("unknown section [{section}]"),
                _ => format!("unknown key {section} (settings go in sections: [dram], [ssd], ...)"),
            };
            let qualified: Vec<String> =
                groups.iter().flat_map(|(g, fs)| fs.iter().map(move |f| format!("[{g}] {}", f.name))).collect();
            let sections: Vec<String> = groups.iter().map(|(g, _)| format!("[{g}]")).collect();
            let suggestion = match body {
                toml::Value::Table(_) => closest(section, "", sections.iter().map(String::as_str)),
                _ => closest(section, &format!(" {section}"), qualified.iter().map(String::as_str)),
            };
            if let Some(best) = suggestion {
                message.push_str(&format!("; did you mean {best}?"));
            }
            return Err(message);
        };
        let toml::Value::Table(body) = body else {
            return Err(format!("[{group}] must be a section, not a value"));
        };
        for (key, value) in body {
            let Some(field) = fields.iter().find(|f| f.name == key.as_str()) else {
                let mut message = format!("unknown key {key} in [{group}]");
                let qualified: Vec<String> = groups
                    .iter()
                    .flat_map(|(g, fs)| fs.iter().map(move |f| (g, f.name)))
                    .map(|(g, f)| if g == group { f.to_string() } else { format!("[{g}] {f}") })
                    .collect();
                if let Some(best) = closest(key, &format!(" {key}"), qualified.iter().map(String::as_str)) {
                    message.push_str(&format!("; did you mean {best}?"));
                }
                return Err(message);
            };
            let text = match value {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(n) => n.to_string(),
                toml::Value::Float(x) => x.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => return Err(format!("[{group}] {key} = {other}: expected a number, string or boolean")),
            };
            settings.set(group, field.name, &text).map_err(|why| format!("[{group}] {key} = {value}: {why}"))?;
            set.push((*group, field.name));
        }
    }
    Ok(set)
}

/// Declares a group of settings once: the struct (public fields with their docs), its
/// `Default`, and its `SettingGroup` impl (name, field list with kinds and examples, setting
/// from text). Each field reads
/// `/// doc` `name: Type = default, Kind, eg "example";` where `Kind` is a `settings::Kind`.
#[macro_export]
macro_rules! settings_group {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident = $group:literal {
            $(
                $(#[doc = $doc:literal])*
                $field:ident: $ty:ty = $default:expr, $kind:ident, eg $example:literal;
            )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq)]
        $vis struct $name {
            $( $(#[doc = $doc])* pub $field: $ty, )*
        }

        impl Default for $name {
            fn default() -> Self {
                Self { $( $field: $default, )* }
            }
        }

        impl $crate::settings::SettingGroup for $name {
            const NAME: &'static str = $group;
            const FIELDS: &'static [$crate::settings::Field] = &[
                $(
                    $crate::settings::Field {
                        name: stringify!($field),
                        kind: $crate::settings::Kind::$kind,
                        optional: <$ty as $crate::settings::SettingValue>::OPTIONAL,
                        doc: concat!($($doc, "\n",)* ""),
                        example: $example,
                    },
                )*
            ];

            fn set(&mut self, field: &str, text: &str) -> Result<bool, String> {
                match field {
                    $(
                        stringify!($field) => {
                            self.$field = <$ty as $crate::settings::SettingValue>::parse_setting(
                                $crate::settings::Kind::$kind,
                                text,
                            )?;
                            Ok(true)
                        }
                    )*
                    _ => Ok(false),
                }
            }

            fn show(&self, field: &str) -> Option<String> {
                match field {
                    $( stringify!($field) => Some(format!("{:?}", self.$field)), )*
                    _ => None,
                }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_booleans_parse() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("64KiB"), Some(64 << 10));
        assert_eq!(parse_bytes("8 GiB"), Some(8 << 30));
        assert_eq!(parse_bytes("1.5m"), Some(3 << 19));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("12XB"), None);
        for (text, v) in [("true", true), ("1", true), ("ON", true), ("off", false), ("0", false), ("False", false)] {
            assert_eq!(bool::parse_setting(Kind::Bool, text), Ok(v), "{text}");
        }
        assert!(bool::parse_setting(Kind::Bool, "maybe").is_err());
        assert_eq!(u32::parse_setting(Kind::Bytes, "4KiB"), Ok(4096));
        assert!(u32::parse_setting(Kind::Bytes, "8GiB").is_err(), "too large for u32");
        assert!(u64::parse_setting(Kind::Count, "4KiB").is_err(), "counts are plain numbers");
    }

    #[test]
    fn suggestions_prefer_the_same_field_in_its_group() {
        let names = ["KVTIDE_SSD_WRITE_THROUGH", "KVTIDE_SSD_BYTES", "KVTIDE_RUNTIME_SHARDS", "KVTIDE_DRAM_BYTES"];
        assert_eq!(closest("KVTIDE_WRITE_THROUGH", "_WRITE_THROUGH", names), Some("KVTIDE_SSD_WRITE_THROUGH"));
        assert_eq!(closest("KVTIDE_SHARDS", "_SHARDS", names), Some("KVTIDE_RUNTIME_SHARDS"));
        assert_eq!(closest("KVTIDE_DRAM_BYTE", "_BYTE", names), Some("KVTIDE_DRAM_BYTES"));
        assert!(is_non_setting_variable("KVTIDE_SIM_SEEDS") && is_non_setting_variable("KVTIDE_LOG"));
        assert!(is_non_setting_variable("KVTIDE_ADDRESS"), "the adapters' variable is never refused");
        assert!(!is_non_setting_variable("KVTIDE_LOGS"));
    }
}
