//! Llama 3.1+ JSON tool calls: the whole output is `{"name": .., "parameters": {..}}` (optionally
//! after `<|python_tag|>`), several separated by `;`. Output that is not such an object is content.

use super::{json_call, may_become, Snapshot};
use crate::json_scan::{scan_object, skip_ws, Scan};

const PYTHON_TAG: &str = "<|python_tag|>";

pub(crate) fn snapshot(text: &str, finished: bool) -> Snapshot {
    let content = |snap: &mut Snapshot| snap.content = text.to_string();
    let mut snap = Snapshot::default();
    let bytes = text.as_bytes();
    let mut i = skip_ws(bytes, 0);
    let lead = &text[i..];
    if !finished && (lead.is_empty() || may_become(lead, PYTHON_TAG)) {
        return snap; // cannot tell content from a call yet
    }
    if let Some(rest) = lead.strip_prefix(PYTHON_TAG) {
        i = text.len() - rest.len();
        i = skip_ws(bytes, i);
    }
    if bytes.get(i) != Some(&b'{') {
        if i < text.len() || finished {
            content(&mut snap);
        }
        return snap;
    }
    // A call's object names its function first ("name", or "type": "function" then "name").
    let first = scan_object(bytes, i);
    match first.fields.first() {
        Some(f) if f.key == "name" || f.key == "type" => {}
        Some(_) => {
            content(&mut snap);
            return snap;
        }
        None if first.invalid || first.end.is_some() || finished => {
            content(&mut snap);
            return snap;
        }
        None => return snap,
    }
    loop {
        let (call, status) = json_call(text, i, &["parameters", "arguments"]);
        match status {
            Scan::Complete(end) => {
                snap.calls.push(call);
                let after = skip_ws(bytes, end);
                match bytes.get(after) {
                    Some(b';') => {
                        i = skip_ws(bytes, after + 1);
                        if i == text.len() || bytes[i] != b'{' {
                            break;
                        }
                    }
                    _ => break,
                }
            }
            Scan::Incomplete => {
                snap.calls.push(call);
                break;
            }
            Scan::Invalid => break,
        }
    }
    if finished {
        snap.calls.retain(|c| c.name.is_some());
    }
    snap
}
