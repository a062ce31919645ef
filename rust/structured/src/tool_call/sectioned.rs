//! Tool calls in a section of special-token markers (DeepSeek-V3, DeepSeek-V3.1, Kimi-K2):
//! `SECTION (CALL header ARGS json [ARGS_CLOSE] CALL_END)* SECTION_END`, after optional content.
//! The formats differ only in their markers and in how the header names the function.

use super::{stable_len, CallSnapshot, Snapshot};
use crate::json_scan::{scan_value, skip_ws, Scan};

/// One format's markers.
pub(crate) struct Markup {
    section: &'static str,
    call: &'static str,
    /// Ends the header; the arguments' JSON follows (after optional whitespace).
    args: &'static str,
    /// Written after the JSON before `call_end` (V3's closing code fence), or "".
    args_close: &'static str,
    call_end: &'static str,
    section_end: &'static str,
    /// The function's name from the header (the text between `call` and `args`).
    name: fn(&str) -> Option<String>,
}

const DS_SECTION: &str = "<｜tool▁calls▁begin｜>";
const DS_CALL: &str = "<｜tool▁call▁begin｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SECTION_END: &str = "<｜tool▁calls▁end｜>";

/// DeepSeek-V3 / R1: `CALL function SEP name \n```json\n{..}\n``` CALL_END`.
pub(crate) const DEEPSEEK_V3: Markup = Markup {
    section: DS_SECTION,
    call: DS_CALL,
    args: "```json",
    args_close: "```",
    call_end: DS_CALL_END,
    section_end: DS_SECTION_END,
    name: |header| {
        let (_kind, name) = header.split_once(DS_SEP)?;
        non_empty(name.trim())
    },
};

/// DeepSeek-V3.1: `CALL name SEP {..} CALL_END` (no call type, no code fence).
pub(crate) const DEEPSEEK_V31: Markup = Markup {
    section: DS_SECTION,
    call: DS_CALL,
    args: DS_SEP,
    args_close: "",
    call_end: DS_CALL_END,
    section_end: DS_SECTION_END,
    name: |header| non_empty(header.trim()),
};

/// Kimi-K2: `CALL functions.name:index ARGUMENT_BEGIN {..} CALL_END`.
pub(crate) const KIMI_K2: Markup = Markup {
    section: "<|tool_calls_section_begin|>",
    call: "<|tool_call_begin|>",
    args: "<|tool_call_argument_begin|>",
    args_close: "",
    call_end: "<|tool_call_end|>",
    section_end: "<|tool_calls_section_end|>",
    name: |header| {
        // The header is Kimi's call id; the name sits between `functions.` and `:index`.
        let id = header.trim();
        let id = id.strip_prefix("functions.").unwrap_or(id);
        let name = match id.rsplit_once(':') {
            Some((name, index)) if index.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => id,
        };
        non_empty(name)
    },
};

fn non_empty(name: &str) -> Option<String> {
    (!name.is_empty()).then(|| name.to_string())
}

pub(crate) fn snapshot(m: &Markup, text: &str, finished: bool) -> Snapshot {
    let mut snap = Snapshot::default();
    let Some(found) = text.find(m.section) else {
        let keep = if finished {
            text.len()
        } else {
            stable_len(text, &[m.section])
        };
        snap.content = text[..keep].to_string();
        return snap;
    };
    snap.content = text[..found].to_string();
    let mut i = found + m.section.len();
    while let Some(next) = call_at(m, text, i, finished, &mut snap) {
        i = next;
    }
    let i = skip_ws(text.as_bytes(), i);
    if let Some(after) = text[i..].strip_prefix(m.section_end) {
        // Text after the section (the model rarely writes any) is content again.
        snap.content.push_str(after);
    }
    if finished {
        snap.calls.retain(|c| c.name.is_some());
    }
    snap
}

/// Reads the call starting at `i` (after whitespace) into `snap`; returns where the next one
/// may start, or None when the calls end here (the section's end, or text still being written).
fn call_at(m: &Markup, text: &str, i: usize, finished: bool, snap: &mut Snapshot) -> Option<usize> {
    let bytes = text.as_bytes();
    let i = skip_ws(bytes, i);
    let header_at = i + text[i..].strip_prefix(m.call).map(|_| m.call.len())?;
    let Some(args_at) = text[header_at..].find(m.args).map(|k| header_at + k) else {
        // The header is still being written: the call exists, its name is not known yet.
        if !finished {
            snap.calls.push(CallSnapshot::default());
        }
        return None;
    };
    let name = (m.name)(&text[header_at..args_at])?;
    let start = skip_ws(bytes, args_at + m.args.len());
    let mut call = CallSnapshot {
        name: Some(name),
        arguments: String::new(),
    };
    let end = match scan_value(bytes, start) {
        Scan::Complete(end) => end,
        Scan::Incomplete => {
            call.arguments = text[start..].to_string();
            snap.calls.push(call);
            return None;
        }
        Scan::Invalid => return None,
    };
    call.arguments = text[start..end].to_string();
    snap.calls.push(call);
    let mut k = skip_ws(bytes, end);
    for marker in [m.args_close, m.call_end] {
        k = skip_ws(
            bytes,
            k + text[k..].strip_prefix(marker).map(|_| marker.len())?,
        );
    }
    Some(k)
}
