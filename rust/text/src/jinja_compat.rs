//! The globals and filters HF `apply_chat_template` adds to Jinja: `tojson`, `raise_exception`, `strftime_now`.

use minijinja::value::Kwargs;
use minijinja::{Error, ErrorKind, Value};
use serde_json::Value as Json;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

/// `raise_exception(msg)`: templates use it to reject malformed conversations.
pub(crate) fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(fmt)`: the current UTC time, formatted like Python's `strftime`.
pub(crate) fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Value::from(strftime(&format, secs)))
}

/// HF's `tojson` is Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: unlike minijinja's built-in it writes `", "`/`": "` separators and does not
/// HTML-escape, which matters because the rendered bytes become the prompt.
pub(crate) fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    let mut out = String::new();
    let style = PyJsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

struct PyJsonStyle {
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJsonStyle {
    fn write(&self, v: &Json, level: usize, out: &mut String) {
        match v {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => out.push_str(&n.to_string()),
            Json::String(s) => self.write_str(s, out),
            Json::Array(items) if items.is_empty() => out.push_str("[]"),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separate(i, level + 1, out);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            Json::Object(map) if map.is_empty() => out.push_str("{}"),
            Json::Object(map) => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    self.separate(i, level + 1, out);
                    self.write_str(k, out);
                    out.push_str(&self.key_sep);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
        }
    }

    fn separate(&self, index: usize, level: usize, out: &mut String) {
        if index > 0 {
            out.push_str(&self.item_sep);
        }
        self.newline(level, out);
    }

    fn newline(&self, level: usize, out: &mut String) {
        if let Some(width) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', width * level));
        }
    }

    fn write_str(&self, s: &str, out: &mut String) {
        // serde_json escapes exactly Python's set: `"`, `\`, and control characters.
        let quoted = serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned());
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// A calendar date-time in UTC.
struct Civil {
    year: i64,
    month: usize, // 1..=12
    day: u32,
    yday: u32,      // 1..=366
    weekday: usize, // 0 = Sunday
    hour: u64,
    minute: u64,
    second: u64,
}

fn civil_from_unix(secs: u64) -> Civil {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's days-from-civil inverse.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as usize;
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUMULATIVE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUMULATIVE[month - 1] + day + u32::from(leap && month > 2);
    Civil {
        year,
        month,
        day,
        yday,
        weekday: (days + 4).rem_euclid(7) as usize,
        hour: rem / 3600,
        minute: rem % 3600 / 60,
        second: rem % 60,
    }
}

/// Python/glibc `strftime` for the specifiers chat templates use; `%-d` style drops padding and
/// unknown specifiers are copied through, as glibc does.
fn strftime(format: &str, unix_secs: u64) -> String {
    let t = civil_from_unix(unix_secs);
    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |out: &mut String, v: u64, width: usize| {
            if unpadded {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{}", t.year);
            }
            Some('y') => num(&mut out, t.year.rem_euclid(100) as u64, 2),
            Some('m') => num(&mut out, t.month as u64, 2),
            Some('d') => num(&mut out, u64::from(t.day), 2),
            Some('e') => {
                let _ = write!(out, "{:>2}", t.day);
            }
            Some('j') => num(&mut out, u64::from(t.yday), 3),
            Some('H') => num(&mut out, t.hour, 2),
            Some('I') => num(&mut out, (t.hour + 11) % 12 + 1, 2),
            Some('M') => num(&mut out, t.minute, 2),
            Some('S') => num(&mut out, t.second, 2),
            Some('p') => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[t.month - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[t.month - 1][..3]),
            Some('A') => out.push_str(WEEKDAYS[t.weekday]),
            Some('a') => out.push_str(&WEEKDAYS[t.weekday][..3]),
            Some('w') => {
                let _ = write!(out, "{}", t.weekday);
            }
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('F') => {
                let _ = write!(out, "{}-{:02}-{:02}", t.year, t.month, t.day);
            }
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_like_python() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
        let t = 1_721_999_109;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            strftime("%A, %B %-d, %Y %H:%M:%S %p %j", t),
            "Friday, July 26, 2024 13:05:09 PM 208"
        );
        assert_eq!(strftime("%y-%m-%d %I %% %Q", t), "24-07-26 01 % %Q");
    }

    #[test]
    fn strftime_handles_epoch_and_leap_day() {
        assert_eq!(strftime("%F %a", 0), "1970-01-01 Thu");
        assert_eq!(strftime("%F %j", 951_782_400), "2000-02-29 060");
    }

    fn render(src: &str, ctx: Json) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(src, ctx).expect("render")
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let ctx = serde_json::json!({"x": {"b": 1, "a": [1.5, "é<>", null, true], "e": {}}});
        assert_eq!(
            render("{{ x | tojson }}", ctx.clone()),
            r#"{"b": 1, "a": [1.5, "é<>", null, true], "e": {}}"#
        );
        assert_eq!(
            render("{{ x | tojson(indent=2, sort_keys=true) }}", ctx.clone()),
            "{\n  \"a\": [\n    1.5,\n    \"é<>\",\n    null,\n    true\n  ],\n  \"b\": 1,\n  \"e\": {}\n}"
        );
        assert_eq!(
            render("{{ x.a[1] | tojson(ensure_ascii=true) }}", ctx),
            r#""\u00e9<>""#
        );
    }
}
