//! Pythonic tool calls (Llama 3.2 / Llama 4): the whole output is a Python list of calls,
//! `[get_weather(city="Paris", days=3), now()]`, optionally inside `<|python_start|>` ..
//! `<|python_end|>`. Keyword values are Python literals; arguments become a JSON object, one
//! key at a time as each value completes.

use super::{may_become, CallSnapshot, Snapshot};
use crate::json_scan::skip_ws;
use serde_json::{Map, Value as Json};

const START: &str = "<|python_start|>";

/// A literal parse: done with the value and the offset after it, not finished yet, or not a
/// Python literal.
enum Lit {
    Done(Json, usize),
    More,
    Bad,
}

pub(crate) fn snapshot(text: &str, finished: bool) -> Snapshot {
    let mut snap = Snapshot::default();
    let bytes = text.as_bytes();
    let mut i = skip_ws(bytes, 0);
    let lead = &text[i..];
    if !finished && (lead.is_empty() || may_become(lead, START)) {
        return snap;
    }
    if let Some(rest) = lead.strip_prefix(START) {
        i = skip_ws(bytes, text.len() - rest.len());
    }
    match looks_like_calls(text, i) {
        Some(true) => {}
        Some(false) => {
            snap.content = text.to_string();
            return snap;
        }
        None if finished => {
            snap.content = text.to_string();
            return snap;
        }
        None => return snap,
    }
    let mut i = skip_ws(bytes, i + 1); // past '['
    loop {
        let name_end = ident_end(bytes, i);
        if name_end == text.len() || bytes[name_end] != b'(' {
            if !finished && name_end == text.len() {
                snap.calls.push(CallSnapshot::default());
            }
            break;
        }
        let mut call = CallSnapshot {
            name: Some(text[i..name_end].to_string()),
            arguments: "{".into(),
        };
        let (end, closed) = keyword_args(text, name_end + 1, &mut call.arguments);
        if closed {
            call.arguments.push('}');
        }
        snap.calls.push(call);
        let Some(end) = end.filter(|_| closed) else {
            break;
        };
        i = skip_ws(bytes, end);
        if bytes.get(i) != Some(&b',') {
            break;
        }
        i = skip_ws(bytes, i + 1);
    }
    if finished {
        snap.calls.retain(|c| c.name.is_some());
    }
    snap
}

/// At `[`: is this a list of calls (`[name(`)? `None` while the text cannot tell yet.
fn looks_like_calls(text: &str, i: usize) -> Option<bool> {
    let bytes = text.as_bytes();
    match bytes.get(i) {
        None => return None,
        Some(b'[') => {}
        Some(_) => return Some(false),
    }
    let start = skip_ws(bytes, i + 1);
    let end = ident_end(bytes, start);
    match bytes.get(end) {
        None => None,
        Some(b'(') if end > start && !bytes[start].is_ascii_digit() => Some(true),
        Some(_) => Some(false),
    }
}

fn ident_end(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || matches!(bytes[i], b'_' | b'.')) {
        i += 1;
    }
    i
}

/// Keyword arguments after `(`: appends `"key": json` for each complete one to `args`.
/// Returns the offset after `)` and whether the call closed.
fn keyword_args(text: &str, mut i: usize, args: &mut String) -> (Option<usize>, bool) {
    let bytes = text.as_bytes();
    let mut first = true;
    loop {
        i = skip_ws(bytes, i);
        match bytes.get(i) {
            None => return (None, false),
            Some(b')') => return (Some(i + 1), true),
            Some(_) => {}
        }
        let key_end = ident_end(bytes, i);
        let eq = skip_ws(bytes, key_end);
        if key_end == i || eq >= text.len() || bytes[eq] != b'=' {
            return (None, false);
        }
        let value_start = skip_ws(bytes, eq + 1);
        let Lit::Done(value, end) = literal(text, value_start) else {
            return (None, false);
        };
        // Complete only once a delimiter follows: `3` may still become `35`.
        let after = skip_ws(bytes, end);
        match bytes.get(after) {
            Some(b',') | Some(b')') => {}
            _ => return (None, false),
        }
        if !first {
            args.push_str(", ");
        }
        first = false;
        args.push_str(&Json::from(&text[i..key_end]).to_string());
        args.push_str(": ");
        args.push_str(&value.to_string());
        i = if bytes[after] == b',' {
            after + 1
        } else {
            after
        };
    }
}

/// A Python literal at `i`: str, int, float, True/False/None, list, tuple, dict.
fn literal(text: &str, i: usize) -> Lit {
    let Some(&c) = text.as_bytes().get(i) else {
        return Lit::More;
    };
    match c {
        b'"' | b'\'' => string(text, i),
        b'[' | b'(' => sequence(text, i),
        b'{' => dict(text, i),
        b'-' | b'+' | b'.' | b'0'..=b'9' => number(text, i),
        _ => word(text, i),
    }
}

/// A list `[...]` or a tuple `(...)` at `i`, as a JSON array.
fn sequence(text: &str, i: usize) -> Lit {
    let bytes = text.as_bytes();
    let c = bytes[i];
    let close = if c == b'[' { b']' } else { b')' };
    let mut items = Vec::new();
    let mut j = skip_ws(bytes, i + 1);
    loop {
        match bytes.get(j) {
            None => return Lit::More,
            Some(&b) if b == close => return Lit::Done(Json::Array(items), j + 1),
            _ => {}
        }
        let Lit::Done(v, end) = literal(text, j) else {
            return literal(text, j);
        };
        items.push(v);
        j = skip_ws(bytes, end);
        match bytes.get(j) {
            None => return Lit::More,
            Some(b',') => j = skip_ws(bytes, j + 1),
            Some(&b) if b == close => {}
            Some(_) => return Lit::Bad,
        }
    }
}

/// A dict `{...}` at `i`; keys that are not strings are written as JSON text.
fn dict(text: &str, i: usize) -> Lit {
    let bytes = text.as_bytes();
    let mut map = Map::new();
    let mut j = skip_ws(bytes, i + 1);
    loop {
        match bytes.get(j) {
            None => return Lit::More,
            Some(b'}') => return Lit::Done(Json::Object(map), j + 1),
            _ => {}
        }
        let (key, end) = match literal(text, j) {
            Lit::Done(Json::String(k), end) => (k, end),
            Lit::Done(other, end) => (other.to_string(), end),
            other => return other,
        };
        j = skip_ws(bytes, end);
        match bytes.get(j) {
            None => return Lit::More,
            Some(b':') => j = skip_ws(bytes, j + 1),
            Some(_) => return Lit::Bad,
        }
        let Lit::Done(v, end) = literal(text, j) else {
            return literal(text, j);
        };
        map.insert(key, v);
        j = skip_ws(bytes, end);
        match bytes.get(j) {
            None => return Lit::More,
            Some(b',') => j = skip_ws(bytes, j + 1),
            Some(b'}') => {}
            Some(_) => return Lit::Bad,
        }
    }
}

/// An int or a float at `i` (underscores allowed), complete once something follows it.
fn number(text: &str, i: usize) -> Lit {
    let bytes = text.as_bytes();
    let mut j = i + 1;
    while j < bytes.len() && matches!(bytes[j], b'0'..=b'9' | b'.' | b'e' | b'E' | b'_')
        || (j < bytes.len()
            && matches!(bytes[j], b'-' | b'+')
            && matches!(bytes[j - 1], b'e' | b'E'))
    {
        j += 1;
    }
    if j == bytes.len() {
        return Lit::More;
    }
    let digits = text[i..j].replace('_', "");
    if let Ok(n) = digits.parse::<i64>() {
        Lit::Done(Json::from(n), j)
    } else if let Some(n) = digits
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
    {
        Lit::Done(Json::Number(n), j)
    } else {
        Lit::Bad
    }
}

/// True/False/None (or JSON's spellings) at `i`; a prefix of one at the end may still become it.
fn word(text: &str, i: usize) -> Lit {
    let bytes = text.as_bytes();
    let end = ident_end(bytes, i);
    let word = &text[i..end];
    let value = match word {
        "True" | "true" => Json::Bool(true),
        "False" | "false" => Json::Bool(false),
        "None" | "null" => Json::Null,
        _ if end == text.len()
            && ["True", "False", "None", "true", "false", "null"]
                .iter()
                .any(|w| w.starts_with(word)) =>
        {
            return Lit::More
        }
        _ => return Lit::Bad,
    };
    if end == text.len() {
        return Lit::More;
    }
    Lit::Done(value, end)
}

/// A quoted Python string with the common escapes.
fn string(text: &str, i: usize) -> Lit {
    let quote = text.as_bytes()[i] as char;
    let mut out = String::new();
    let mut chars = text[i + 1..].char_indices();
    while let Some((k, c)) = chars.next() {
        match c {
            '\\' => {
                let Some((_, e)) = chars.next() else {
                    return Lit::More;
                };
                match e {
                    'n' => out.push('\n'),
                    't' => out.push('\t'),
                    'r' => out.push('\r'),
                    '0' => out.push('\0'),
                    'u' | 'x' => {
                        let n = if e == 'u' { 4 } else { 2 };
                        let hex: String = chars.by_ref().take(n).map(|(_, h)| h).collect();
                        if hex.len() < n {
                            return Lit::More;
                        }
                        match u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32) {
                            Some(ch) => out.push(ch),
                            None => return Lit::Bad,
                        }
                    }
                    other => out.push(other),
                }
            }
            c if c == quote => return Lit::Done(Json::String(out), i + 1 + k + 1),
            c => out.push(c),
        }
    }
    Lit::More
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_literals_become_json() {
        let text = r#"{'a': [1, -2.5, True, None], "b": ("x", 'it\'s')} "#;
        let Lit::Done(v, _) = literal(text, 0) else {
            panic!("not parsed")
        };
        assert_eq!(
            v,
            serde_json::json!({"a": [1, -2.5, true, null], "b": ["x", "it's"]})
        );
    }
}
