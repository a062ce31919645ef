//! Mistral tool calls after `[TOOL_CALLS]`: a JSON array `[{"name": .., "arguments": {..}}, ..]`
//! (v3 tokenizers) or `name[ARGS]{..}` per call (v11+ tokenizers), after optional content.

use super::{json_call, stable_len, CallSnapshot, Snapshot};
use crate::json_scan::{scan_value, skip_ws, Scan};

const TOOL_CALLS: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";

pub(crate) fn snapshot(text: &str, finished: bool) -> Snapshot {
    let mut snap = Snapshot::default();
    let Some(found) = text.find(TOOL_CALLS) else {
        let keep = if finished {
            text.len()
        } else {
            stable_len(text, &[TOOL_CALLS])
        };
        snap.content = text[..keep].to_string();
        return snap;
    };
    snap.content = text[..found].to_string();
    let bytes = text.as_bytes();
    let i = skip_ws(bytes, found + TOOL_CALLS.len());
    if i == text.len() {
        return snap;
    }
    if bytes[i] == b'[' {
        array_calls(text, i + 1, &mut snap);
    } else {
        named_calls(text, i, finished, &mut snap);
    }
    if finished {
        snap.calls.retain(|c| c.name.is_some());
    }
    snap
}

/// `[{..}, {..}]` starting after the `[`.
pub(crate) fn array_calls(text: &str, mut i: usize, snap: &mut Snapshot) {
    let bytes = text.as_bytes();
    loop {
        i = skip_ws(bytes, i);
        if bytes.get(i) != Some(&b'{') {
            return;
        }
        let (call, status) = json_call(text, i, &["arguments", "parameters"]);
        snap.calls.push(call);
        let Scan::Complete(end) = status else { return };
        i = skip_ws(bytes, end);
        if bytes.get(i) != Some(&b',') {
            return;
        }
        i += 1;
    }
}

/// `name[ARGS]{..}` repeated, each after its own `[TOOL_CALLS]`.
fn named_calls(text: &str, mut i: usize, finished: bool, snap: &mut Snapshot) {
    let bytes = text.as_bytes();
    loop {
        let Some(args_at) = text[i..].find(ARGS).map(|k| i + k) else {
            // The name is still being written.
            if !finished {
                snap.calls.push(CallSnapshot::default());
            }
            return;
        };
        let name = text[i..args_at].trim().to_string();
        let start = skip_ws(bytes, args_at + ARGS.len());
        let mut call = CallSnapshot {
            name: Some(name),
            arguments: String::new(),
        };
        match scan_value(bytes, start) {
            Scan::Complete(end) => {
                call.arguments = text[start..end].to_string();
                snap.calls.push(call);
                let next = skip_ws(bytes, end);
                match text[next..].strip_prefix(TOOL_CALLS) {
                    Some(rest) => i = skip_ws(bytes, text.len() - rest.len()),
                    None => return,
                }
            }
            Scan::Incomplete => {
                call.arguments = text[start..].to_string();
                snap.calls.push(call);
                return;
            }
            Scan::Invalid => return,
        }
    }
}
