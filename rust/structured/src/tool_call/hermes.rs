//! Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>`,
//! one block per call, after optional content.

use super::{json_call, may_become, stable_len, CallSnapshot, Snapshot};
use crate::json_scan::{skip_ws, Scan};

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";

pub(crate) fn snapshot(text: &str, finished: bool) -> Snapshot {
    let mut snap = Snapshot::default();
    let mut pos = 0;
    while pos < text.len() {
        let Some(found) = text[pos..].find(START) else {
            let rest = &text[pos..];
            let keep = if finished {
                rest.len()
            } else {
                stable_len(rest, &[START])
            };
            snap.content.push_str(&rest[..keep]);
            break;
        };
        snap.content.push_str(&text[pos..pos + found]);
        let block = pos + found;
        let body = skip_ws(text.as_bytes(), block + START.len());
        if body == text.len() {
            break; // the call's JSON has not started
        }
        let (call, status) = json_call(text, body, &["arguments", "parameters"]);
        match status {
            Scan::Complete(end) => {
                snap.calls.push(call);
                let after = skip_ws(text.as_bytes(), end);
                let rest = &text[after..];
                if let Some(stripped) = rest.strip_prefix(END) {
                    // Whitespace between calls (and before any text after them) is layout.
                    pos = skip_ws(text.as_bytes(), text.len() - stripped.len());
                } else if rest.is_empty() || (!finished && may_become(rest, END)) {
                    break; // the closing tag is coming (or, at the end, was never written)
                } else {
                    pos = after; // no closing tag: what follows is content again
                }
            }
            Scan::Incomplete => {
                snap.calls.push(call);
                break;
            }
            Scan::Invalid => {
                // Not a call after all: the block is content (sent once the output ends, so a
                // stream never shows a call's JSON as content by mistake).
                if finished {
                    snap.content.push_str(&text[block..]);
                }
                break;
            }
        }
    }
    snap.calls
        .retain(|c: &CallSnapshot| c.name.is_some() || !finished);
    snap
}
