//! GPT-OSS's harmony output: reasoning, answer and tool calls from one channelled text.
//!
//! The generation prompt ends with `<|start|>assistant`, so the output is a run of messages,
//! `[<|start|>assistant]HEADER<|message|>BODY` ended by `<|end|>` (more messages follow),
//! `<|call|>` (a tool call) or `<|return|>` (done); the last two are stop tokens. The header
//! names the channel (`<|channel|>analysis`) and perhaps a recipient (`to=functions.NAME`, in
//! the role or the channel part) and a content type (`<|constrain|>json`):
//!
//! ```text
//! <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
//! to=functions.get_weather <|constrain|>json<|message|>{"city":"SF"}<|call|>
//! ```
//!
//! A body goes by its header: to `functions.NAME` (when calls are parsed) it is that call's
//! arguments, as written; on the `analysis` channel it is reasoning; anything else (`final`, a
//! `commentary` preamble) is the answer. Messages of one kind join with a newline. The markers
//! are special tokens of the o200k_harmony vocabulary: they reach this parser only when the
//! request keeps special tokens. A text without any marker (special tokens skipped) is all
//! answer; a header cut short (max_tokens) adds nothing.
//!
//! As for the other parsers, `snapshot` is what a text prefix says for sure and a stream diffs
//! snapshots, so streamed deltas concatenate to the whole parse.

use crate::tool_call::{diff_text, stable_len, CallDiff, CallSnapshot, ToolCall, ToolCallDelta};

pub const START: &str = "<|start|>";
pub const CHANNEL: &str = "<|channel|>";
pub const MESSAGE: &str = "<|message|>";
pub const CONSTRAIN: &str = "<|constrain|>";
pub const END: &str = "<|end|>";
pub const CALL: &str = "<|call|>";
pub const RETURN: &str = "<|return|>";

/// What ends a body: its end markers, and (malformed, no `<|end|>` first) any marker that
/// starts a header, so a marker never shows as text.
const BODY_ENDS: [&str; 7] = [END, CALL, RETURN, START, CHANNEL, MESSAGE, CONSTRAIN];
/// The body ends that belong to the next message's header.
const HEADER_MARKERS: [&str; 4] = [START, CHANNEL, MESSAGE, CONSTRAIN];
/// The recipient prefix of a function call (built-in tools, `browser.*` and `python`, are not).
const FUNCTIONS: &str = "functions.";

/// A whole output, split.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HarmonyMessage {
    /// The `analysis` channel.
    pub reasoning_content: String,
    /// The `final` channel and `commentary` preambles.
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// What one streamed text delta adds (a call's name in its first delta, as OpenAI streams).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HarmonyDelta {
    pub reasoning_content: String,
    pub content: String,
    pub tool_calls: Vec<ToolCallDelta>,
}

/// What a text prefix says for sure.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Snapshot {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<CallSnapshot>,
}

/// Where a message's body goes.
enum Part {
    Reasoning,
    Content,
    Call(String),
}

/// Splits a whole output; `calls`: read `functions.*` messages as tool calls (else they are
/// answer text, like any unparsed call markup).
pub fn parse(text: &str, calls: bool) -> HarmonyMessage {
    let snap = snapshot(text, calls, true);
    HarmonyMessage {
        reasoning_content: snap.reasoning,
        content: snap.content,
        tool_calls: snap
            .calls
            .into_iter()
            .filter_map(CallSnapshot::into_call)
            .collect(),
    }
}

/// A parser for one streamed response.
pub fn stream(calls: bool) -> HarmonyStream {
    HarmonyStream {
        calls,
        text: String::new(),
        sent_reasoning: String::new(),
        sent_content: String::new(),
        sent_calls: CallDiff::default(),
    }
}

/// Streaming state: the text so far and what was sent of its snapshot.
pub struct HarmonyStream {
    calls: bool,
    text: String,
    sent_reasoning: String,
    sent_content: String,
    sent_calls: CallDiff,
}

impl HarmonyStream {
    /// Feeds the next text delta; returns what can be sent now.
    pub fn push(&mut self, delta: &str) -> HarmonyDelta {
        self.text.push_str(delta);
        let snap = snapshot(&self.text, self.calls, false);
        self.diff(snap)
    }

    /// The output ended: returns whatever was held back.
    pub fn finish(&mut self) -> HarmonyDelta {
        let snap = snapshot(&self.text, self.calls, true);
        self.diff(snap)
    }

    fn diff(&mut self, snap: Snapshot) -> HarmonyDelta {
        HarmonyDelta {
            reasoning_content: diff_text(&mut self.sent_reasoning, snap.reasoning),
            content: diff_text(&mut self.sent_content, snap.content),
            tool_calls: self.sent_calls.diff(snap.calls),
        }
    }
}

/// What `text` says for sure; `finished` releases a held-back partial marker and completes the
/// last message.
pub(crate) fn snapshot(text: &str, calls: bool, finished: bool) -> Snapshot {
    let mut snap = Snapshot::default();
    let mut pos = 0;
    while let Some(header_len) = text[pos..].find(MESSAGE) {
        let part = classify(&text[pos..pos + header_len], calls);
        let body_start = pos + header_len + MESSAGE.len();
        let rest = &text[body_start..];
        let (body, next) = match first_end(rest) {
            Some((at, marker)) => {
                let skip = if HEADER_MARKERS.contains(&marker) {
                    0
                } else {
                    marker.len()
                };
                (&rest[..at], Some(body_start + at + skip))
            }
            None if finished => (rest, None),
            None => (&rest[..stable_len(rest, &BODY_ENDS)], None),
        };
        add(&mut snap, part, body, next.is_some() || finished);
        match next {
            Some(n) => pos = n,
            None => return snap,
        }
    }
    if finished && !BODY_ENDS.iter().any(|m| text.contains(m)) {
        snap.content = text.to_string(); // not harmony at all (special tokens skipped)
    }
    snap
}

/// The earliest body end in `text`, and which marker it is.
fn first_end(text: &str) -> Option<(usize, &'static str)> {
    BODY_ENDS
        .iter()
        .filter_map(|m| text.find(m).map(|at| (at, *m)))
        .min_by_key(|(at, _)| *at)
}

/// Where a message with this header goes.
fn classify(header: &str, calls: bool) -> Part {
    let recipient = field(header, "to=");
    if let Some(name) = recipient.and_then(|r| r.strip_prefix(FUNCTIONS)) {
        if calls && !name.is_empty() {
            return Part::Call(name.to_string());
        }
    }
    match field(header, CHANNEL) {
        Some("analysis") => Part::Reasoning,
        _ => Part::Content,
    }
}

/// The word after `key` in a header: up to whitespace or the next marker.
fn field<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header.find(key)? + key.len();
    let value = header[at..].trim_start();
    let end = value
        .find(|c: char| c.is_whitespace() || c == '<')
        .unwrap_or(value.len());
    Some(&value[..end])
}

fn add(snap: &mut Snapshot, part: Part, body: &str, complete: bool) {
    let text = match part {
        Part::Reasoning => &mut snap.reasoning,
        Part::Content => &mut snap.content,
        Part::Call(name) => {
            // A call without arguments gets `{}` once complete (OpenAI clients parse them).
            let arguments = match body.trim().is_empty() {
                true if complete => "{}".to_string(),
                true => String::new(),
                false => body.to_string(),
            };
            snap.calls.push(CallSnapshot {
                name: Some(name),
                arguments,
            });
            return;
        }
    };
    if !body.is_empty() {
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(body);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_fields_stop_at_whitespace_and_markers() {
        let h =
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json";
        assert_eq!(field(h, CHANNEL), Some("commentary"));
        assert_eq!(field(h, "to="), Some("functions.get_weather"));
        let h = " to=functions.f<|channel|>commentary json";
        assert_eq!(field(h, "to="), Some("functions.f"));
        assert_eq!(field(h, CHANNEL), Some("commentary"));
        assert_eq!(field("<|channel|>final", "to="), None);
    }
}
