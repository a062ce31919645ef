//! A JSON scanner over possibly unfinished text: where a value ends, or that it has not ended
//! yet. Tool-call parsers use it to find a call's name and the exact text of its arguments while
//! the model is still writing them.

/// The outcome of scanning one value starting at an offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scan {
    /// The value ends just before this byte offset.
    Complete(usize),
    /// The text ends inside the value (it may still become valid).
    Incomplete,
    /// Not JSON.
    Invalid,
}

pub(crate) fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && matches!(s[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// Scans the JSON value starting at `i` (no leading whitespace).
pub(crate) fn scan_value(s: &[u8], i: usize) -> Scan {
    let Some(&c) = s.get(i) else {
        return Scan::Incomplete;
    };
    match c {
        b'"' => scan_string(s, i),
        b'{' | b'[' => scan_container(s, i),
        b't' => scan_literal(s, i, b"true"),
        b'f' => scan_literal(s, i, b"false"),
        b'n' => scan_literal(s, i, b"null"),
        b'-' | b'0'..=b'9' => {
            let mut j = i + 1;
            while j < s.len() && matches!(s[j], b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-') {
                j += 1;
            }
            // A number at the end of the text may still grow.
            if j == s.len() {
                Scan::Incomplete
            } else {
                Scan::Complete(j)
            }
        }
        _ => Scan::Invalid,
    }
}

fn scan_literal(s: &[u8], i: usize, word: &[u8]) -> Scan {
    let have = &s[i..s.len().min(i + word.len())];
    if have == word {
        Scan::Complete(i + word.len())
    } else if word.starts_with(have) {
        Scan::Incomplete
    } else {
        Scan::Invalid
    }
}

fn scan_string(s: &[u8], i: usize) -> Scan {
    let mut j = i + 1;
    while j < s.len() {
        match s[j] {
            b'\\' => j += 2,
            b'"' => return Scan::Complete(j + 1),
            _ => j += 1,
        }
    }
    Scan::Incomplete
}

/// Objects and arrays: brackets balanced outside strings. Structure inside is checked only as
/// far as the parsers need (serde_json parses complete values before they are used).
fn scan_container(s: &[u8], i: usize) -> Scan {
    let mut stack = Vec::new();
    let mut j = i;
    while j < s.len() {
        match s[j] {
            b'"' => match scan_string(s, j) {
                Scan::Complete(end) => {
                    j = end;
                    continue;
                }
                other => return other,
            },
            open @ (b'{' | b'[') => stack.push(open),
            close @ (b'}' | b']') => {
                let expected = if close == b'}' { b'{' } else { b'[' };
                if stack.pop() != Some(expected) {
                    return Scan::Invalid;
                }
                if stack.is_empty() {
                    return Scan::Complete(j + 1);
                }
            }
            _ => {}
        }
        j += 1;
    }
    Scan::Incomplete
}

/// One `"key": value` of an object being scanned.
#[derive(Debug, Clone)]
pub(crate) struct Field {
    pub key: String,
    pub value_start: usize,
    /// `None` while the value is unfinished (it then runs to the end of the text).
    pub value_end: Option<usize>,
}

/// The fields of the object starting at `i`, as far as the text goes.
#[derive(Debug, Clone)]
pub(crate) struct ObjectScan {
    pub fields: Vec<Field>,
    /// Offset just past the closing brace, once there is one.
    pub end: Option<usize>,
    pub invalid: bool,
}

pub(crate) fn scan_object(s: &[u8], i: usize) -> ObjectScan {
    let mut out = ObjectScan {
        fields: Vec::new(),
        end: None,
        invalid: false,
    };
    if s.get(i) != Some(&b'{') {
        out.invalid = s.get(i).is_some();
        return out;
    }
    let mut j = skip_ws(s, i + 1);
    if s.get(j) == Some(&b'}') {
        out.end = Some(j + 1);
        return out;
    }
    loop {
        let Some(&c) = s.get(j) else { return out };
        if c != b'"' {
            out.invalid = true;
            return out;
        }
        let key_end = match scan_string(s, j) {
            Scan::Complete(end) => end,
            _ => return out,
        };
        let Ok(key) = serde_json::from_slice::<String>(&s[j..key_end]) else {
            out.invalid = true;
            return out;
        };
        j = skip_ws(s, key_end);
        match s.get(j) {
            None => return out,
            Some(b':') => {}
            Some(_) => {
                out.invalid = true;
                return out;
            }
        }
        let value_start = skip_ws(s, j + 1);
        if value_start == s.len() {
            return out;
        }
        match scan_value(s, value_start) {
            Scan::Complete(end) => {
                out.fields.push(Field {
                    key,
                    value_start,
                    value_end: Some(end),
                });
                j = skip_ws(s, end);
            }
            Scan::Incomplete => {
                out.fields.push(Field {
                    key,
                    value_start,
                    value_end: None,
                });
                return out;
            }
            Scan::Invalid => {
                out.invalid = true;
                return out;
            }
        }
        match s.get(j) {
            None => return out,
            Some(b',') => j = skip_ws(s, j + 1),
            Some(b'}') => {
                out.end = Some(j + 1);
                return out;
            }
            Some(_) => {
                out.invalid = true;
                return out;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_end_where_json_says() {
        let s = br#"{"a": [1, "]}"], "b": {"c": null}} tail"#;
        assert_eq!(scan_value(s, 0), Scan::Complete(34));
        assert_eq!(scan_value(br#""x\"y" "#, 0), Scan::Complete(6));
        assert_eq!(scan_value(b"12 ", 0), Scan::Complete(2));
        assert_eq!(scan_value(b"12", 0), Scan::Incomplete);
        assert_eq!(scan_value(b"tr", 0), Scan::Incomplete);
        assert_eq!(scan_value(b"tx", 0), Scan::Invalid);
        assert_eq!(scan_value(b"{\"a\": [1}", 0), Scan::Invalid);
    }

    #[test]
    fn object_fields_are_found_while_unfinished() {
        let s = br#"{"name": "f", "arguments": {"x": "#;
        let o = scan_object(s, 0);
        assert!(!o.invalid && o.end.is_none());
        assert_eq!(o.fields[0].key, "name");
        assert_eq!(o.fields[1].key, "arguments");
        assert_eq!(o.fields[1].value_end, None);
        assert_eq!(&s[o.fields[1].value_start..], br#"{"x": "#);
    }
}
